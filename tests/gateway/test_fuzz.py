"""Schemathesis against the gateway's own OpenAPI schema (real uvicorn, fake scheduler): no
generated request may get a 5xx, and schemathesis' conformance checks pass: every status, content
type, header and body answered is one the schema documents (errors in the OpenAI shape, streamed
calls as text/event-stream). Bounded (max examples per operation) so it runs in well under a
minute. Two requests the schema allows were once refused (an empty guided_choice, top_logprobs
without logprobs): the schema now forbids the first and the server accepts the second, and no
generated request may be refused for them again."""
from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.gateway_fakes import Plan

MAX_EXAMPLES = 60
SEEN: Counter = Counter()  # (method path, status // 100) of every generated call
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def fuzz_stack():
    """Module-scoped twin of make_stack (the schema must be loaded once)."""
    from gateway.app import create_app
    from shared.config import ModelInfo
    from shared.queue import QueueConfig, make_queues
    from tests.support.gateway_fakes import MAX_MODEL_LEN, FakeScheduler, ServerThread, smollm2_tokenizer

    tok = smollm2_tokenizer()
    gq, sq = make_queues(None, config=QueueConfig(prefix="fuzz:"), consumer="fake-scheduler")
    info = ModelInfo("smol-test", MAX_MODEL_LEN, tok.vocab_size, tok.eos_token_ids)
    fake = FakeScheduler(sq, tok, plan=lambda req: Plan("Hi"))
    server = ServerThread(create_app(tok, info, gq, max_body_bytes=64 << 10, event_timeout_s=10))
    yield server
    server.stop()
    fake.close()


def _schema() -> dict:
    """The app's OpenAPI document (it depends on the routes and models only, not on the
    tokenizer or the queue, so a bare app gives it at import time)."""
    from gateway.app import create_app
    from shared.config import ModelInfo
    from shared.queue import make_queues

    return create_app(None, ModelInfo("smol-test", 256, 100, [0]), make_queues(None)[0]).openapi()


schema = schemathesis.openapi.from_dict(_schema())


def openai_error_shape(response) -> None:
    """4xx: {"error": {"message": str, "type": str, "param": str|null, "code": str|null}}."""
    if 400 <= response.status_code < 500:
        err = response.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert isinstance(err["type"], str)
        assert set(err) == {"message", "type", "param", "code"}


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_every_answer_conforms_to_the_schema(case, fuzz_stack):
    response = case.call_and_validate(base_url=fuzz_stack.url, timeout=20, checks=CHECKS)
    SEEN[f"{case.method} {case.path}", response.status_code // 100] += 1
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {response.status_code}: " \
                                       f"{response.text[:300]}"
    openai_error_shape(response)
    if response.status_code == 400:
        err = response.json()["error"]
        assert "needs logprobs" not in err["message"], err     # top_logprobs alone is accepted
        assert "non-empty list of non-empty strings" not in err["message"], err   # minItems 1 now


def test_the_fuzzing_reached_both_answers_of_the_generation_endpoints():
    """Runs after the fuzz cases (file order): valid bodies got answers, invalid ones 4xx."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert SEEN[f"POST {path}", 2] > 0 and SEEN[f"POST {path}", 4] > 0, dict(SEEN)

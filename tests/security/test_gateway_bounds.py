"""Every list and text field of the API has a bound: the OpenAPI schema states it, and a request
over it is a 400 in OpenAI's shape, naming the field, answered while the body is parsed (under
50 ms on a real uvicorn server, however large the field). Also the two requests the schema
allowed and the server refused: an empty guided_choice (now outside the schema) and
top_logprobs without logprobs (now accepted).

A time is the best of three tries: the machines these tests run on are shared, and a neighbour's
burst must not pass for the server's work."""
from __future__ import annotations

import time

import httpx
import pytest

from shared import limits as L

MSG = [{"role": "user", "content": "Hi"}]
SCHEMA_BIG = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 64}
                                               for i in range(L.MAX_SCHEMA_CHARS // 64)}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

# (field named in the 400's param, the oversized part of a chat body)
OVERSIZE = [
    ("stop_token_ids", {"stop_token_ids": list(range(100_000))}),
    ("logit_bias", {"logit_bias": {str(i): 1.0 for i in range(5_000)}}),
    ("guided_choice", {"guided_choice": [f"c{i}" for i in range(50_000)]}),
    ("guided_choice.0", {"guided_choice": ["x" * (L.MAX_GUIDED_CHOICE_CHARS + 1)]}),
    ("structured_outputs.choice", {"structured_outputs": {"choice": ["a"] * (L.MAX_GUIDED_CHOICES + 1)}}),
    ("guided_regex", {"guided_regex": "a" * (L.MAX_REGEX_CHARS + 1)}),
    ("guided_grammar", {"guided_grammar": "start: " + "\"a\" " * L.MAX_GRAMMAR_CHARS}),
    ("guided_json", {"guided_json": SCHEMA_BIG}),
    ("response_format.json_schema.schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA_BIG}}}),
    ("stop", {"stop": ["s"] * (L.MAX_STOP + 1)}),
    ("stop", {"stop": "s" * (L.MAX_STOP_CHARS + 1)}),
    ("tools", {"tools": [TOOL] * (L.MAX_TOOLS + 1)}),
    ("messages", {"messages": MSG * (L.MAX_MESSAGES + 1)}),
    ("messages", {"messages": [{"role": "user", "content": "x" * (L.MAX_TEXT_CHARS + 1)}]}),
    ("messages", {"messages": [{"role": "user", "content": "x" * 600_000}] * 2}),
    ("n", {"n": 17}),
    ("max_tokens", {"max_tokens": L.MAX_TOKENS + 1}),
    ("metadata", {"metadata": {f"k{i}": "v" for i in range(L.MAX_METADATA + 1)}}),
    ("user", {"user": "u" * (L.MAX_NAME_CHARS + 1)}),
]


def timed_post(client: httpx.Client, path: str, content: bytes, tries: int = 3) -> tuple[httpx.Response, float]:
    """(the answer, the fastest of `tries` identical posts in seconds)."""
    best, r = float("inf"), None
    for _ in range(tries):
        t0 = time.perf_counter()
        r = client.post(path, content=content, headers={"Content-Type": "application/json"})
        best = min(best, time.perf_counter() - t0)
    return r, best


@pytest.fixture(scope="module")
def stack(request, tokenizer):
    from gateway.app import create_app
    from shared.config import ModelInfo
    from shared.queue import QueueConfig, make_queues
    from tests.support.gateway_fakes import FakeScheduler, Plan, ServerThread

    gq, sq = make_queues(None, config=QueueConfig(prefix="bounds:"), consumer="fake-scheduler")
    info = ModelInfo("smol-test", 256, tokenizer.vocab_size, tokenizer.eos_token_ids)
    fake = FakeScheduler(sq, tokenizer, plan=lambda req: Plan("Hi"))
    server = ServerThread(create_app(tokenizer, info, gq))
    yield server.url, fake
    server.stop()
    fake.close()


@pytest.fixture(scope="module")
def client(stack):
    with httpx.Client(base_url=stack[0], timeout=30) as c:
        c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})   # warm: first-call costs
        yield c


@pytest.mark.parametrize("param,extra", OVERSIZE, ids=[f"{p}-{i}" for i, (p, _) in enumerate(OVERSIZE)])
def test_an_oversized_field_is_a_fast_400_naming_it(client, param, extra):
    body = {"messages": MSG, "max_tokens": 4, **extra}
    content = httpx.Request("POST", "/", json=body).content   # serialized before the clock starts
    r, elapsed = timed_post(client, "/v1/chat/completions", content)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"].startswith(param), err
    assert elapsed < 0.05, f"{param}: {elapsed * 1000:.0f} ms"


def test_an_oversized_prompt_and_token_list_are_400_on_completions(client):
    for prompt, param in (("x" * (L.MAX_TEXT_CHARS + 1), "prompt"),
                          ([[1] * 10] * (L.MAX_PROMPTS + 1), "prompt")):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text[:300]


def test_text_longer_than_the_context_can_hold_is_refused_without_tokenizing(client, tokenizer):
    longest = max(map(len, tokenizer.backend.get_vocab(with_added_tokens=True)))
    r = client.post("/v1/completions", json={"prompt": "x" * (256 * longest + 1), "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]


def test_the_openapi_schema_states_the_bounds(client):
    doc = client.get("/openapi.json").json()
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]

    def arm(prop: dict) -> dict:   # the non-null arm of an optional field
        return next((a for a in prop.get("anyOf", [prop]) if a.get("type") != "null"), prop)

    assert arm(chat["stop_token_ids"])["maxItems"] == L.MAX_STOP_TOKEN_IDS
    assert arm(chat["logit_bias"])["maxProperties"] == L.MAX_LOGIT_BIAS
    choice = arm(chat["guided_choice"])
    assert choice["minItems"] == 1 and choice["maxItems"] == L.MAX_GUIDED_CHOICES
    assert choice["items"]["maxLength"] == L.MAX_GUIDED_CHOICE_CHARS
    assert arm(chat["guided_regex"])["maxLength"] == L.MAX_REGEX_CHARS
    assert arm(chat["guided_grammar"])["maxLength"] == L.MAX_GRAMMAR_CHARS
    assert arm(chat["tools"])["maxItems"] == L.MAX_TOOLS
    assert chat["messages"]["maxItems"] == L.MAX_MESSAGES
    assert arm(chat["max_tokens"])["maximum"] == L.MAX_TOKENS
    assert str(L.MAX_SCHEMA_CHARS) in chat["guided_json"]["description"]
    prompt = doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert prompt[0]["maxLength"] == L.MAX_TEXT_CHARS and prompt[1]["maxItems"] == L.MAX_PROMPTS


def test_an_empty_guided_choice_is_outside_the_schema_and_a_400(client):
    r = client.post("/v1/chat/completions", json={"messages": MSG, "guided_choice": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_choice"


def test_top_logprobs_without_logprobs_is_accepted_and_turns_logprobs_on(client):
    r = client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 4, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 4, "top_logprobs": 2,
                                                  "logprobs": False})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("extra", [{"stop_token_ids": list(range(400_000))},
                                   {"logit_bias": {str(i): 1.0 for i in range(200_000)}}],
                         ids=["stop_token_ids", "logit_bias"])
def test_a_body_with_too_many_values_is_a_fast_400_before_it_is_parsed(client, extra):
    content = httpx.Request("POST", "/", json={"messages": MSG, **extra}).content
    assert content.count(b",") > L.MAX_BODY_COMMAS or content.count(b":") > L.MAX_BODY_COLONS
    r, elapsed = timed_post(client, "/v1/chat/completions", content)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_values", r.text[:300]
    assert elapsed < 0.05, f"{elapsed * 1000:.0f} ms"


def test_a_token_id_prompt_at_the_bound_still_parses(client):
    r = client.post("/v1/completions", json={"prompt": [1] * L.MAX_PROMPT_TOKEN_IDS, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]


def test_the_bounds_table_in_the_docs_states_the_limits():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    for name in ("MAX_TEXT_CHARS", "MAX_PROMPT_TOKEN_IDS", "MAX_BODY_COMMAS", "MAX_BODY_COLONS", "MAX_MESSAGES",
                 "MAX_STOP_TOKEN_IDS", "MAX_LOGIT_BIAS", "MAX_GUIDED_CHOICES", "MAX_REGEX_CHARS", "MAX_GRAMMAR_CHARS",
                 "MAX_SCHEMA_CHARS", "MAX_TOOLS_CHARS", "MAX_ARGUMENTS_CHARS", "MAX_DESCRIPTION_CHARS", "MAX_TOKENS"):
        assert f"{getattr(L, name):,}" in doc, name


@pytest.mark.parametrize("content", [b"[" * 100_000, b'{"messages": ' + b"[" * 50_000, b"\xff\xfe{}"],
                         ids=["deep", "deep-in-a-field", "not-utf8"])
def test_a_body_that_cannot_be_parsed_is_a_400(client, content):
    r = client.post("/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}

"""How the gateway handles a request's token stream: stop strings, client disconnects,
duplicate events, error events. Each early end must reach the scheduler as an abort."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.support.gateway_fakes import Plan, metric


@pytest.mark.parametrize("backend", ["local", "redis"])
def test_a_stop_string_ends_the_text_before_it_and_aborts_the_request(make_stack, backend):
    stack = make_stack(backend, plan=lambda req: Plan("alpha beta END gamma", hold=True))
    r = stack.client().completions.create(model="smol-test", prompt="x", max_tokens=100, stop=["END"])
    assert r.choices[0].text == "alpha beta "
    assert r.choices[0].finish_reason == "stop"
    assert stack.fake.wait_aborted(stack.fake.received[0].req_id)


def test_a_stop_string_split_across_tokens_is_found_in_a_stream(make_stack):
    stack = make_stack(plan=lambda req: Plan("one. The answer is: 42. Thanks", hold=True))
    chunks = list(stack.client().completions.create(model="smol-test", prompt="x", max_tokens=100,
                                                    stop=["is: 4"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "one. The answer "
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert stack.fake.wait_aborted(stack.fake.received[0].req_id)


def test_a_request_that_ends_normally_is_not_aborted(make_stack):
    stack = make_stack()
    stack.client().completions.create(model="smol-test", prompt="x", max_tokens=50, stop=["never"])
    time.sleep(0.2)
    assert stack.fake.aborted == []


@pytest.mark.parametrize("backend", ["local", "redis"])
def test_a_client_disconnecting_mid_stream_aborts_its_request(make_stack, backend):
    stack = make_stack(backend, plan=lambda req: Plan("tick ", interval_s=0.02, hold=True))
    body = {"model": "smol-test", "prompt": "x", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=10) as resp:
        first = next(resp.iter_lines())
        assert first.startswith("data: ")
    assert stack.fake.wait_aborted(stack.fake.received[0].req_id)


def test_a_client_disconnecting_from_a_non_streamed_request_aborts_it(make_stack):
    stack = make_stack(plan=lambda req: Plan("tick ", interval_s=0.02, hold=True))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.url + "/v1/completions", json={"model": "smol-test", "prompt": "x", "max_tokens": 200},
                   timeout=0.5)
    assert stack.fake.wait_aborted(stack.fake.received[0].req_id)


@pytest.mark.parametrize("backend", ["local", "redis"])
def test_duplicate_and_replayed_events_are_dropped(make_stack, backend):
    text = "The quick brown fox jumps over the lazy dog."
    stack = make_stack(backend, plan=lambda req: Plan(text, duplicate=True))
    r = stack.client().completions.create(model="smol-test", prompt="x", max_tokens=100)
    assert r.choices[0].text == text
    assert metric(stack.url, "sarathi_gateway_duplicate_events_dropped_total") > 0


def test_an_error_event_in_a_stream_becomes_an_sse_error_then_done(make_stack):
    stack = make_stack(plan=lambda req: Plan("some words here", error_after=2))
    body = {"model": "smol-test", "prompt": "x", "max_tokens": 50, "stream": True}
    lines = [ln for ln in httpx.post(stack.url + "/v1/completions", json=body).text.splitlines() if ln]
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert err["message"] == "worker exploded" and err["code"] == "generation_error"
    with pytest.raises(openai.APIError, match="worker exploded"):
        list(stack.client().completions.create(model="smol-test", prompt="x", max_tokens=50, stream=True))


def test_an_error_event_fails_a_non_streamed_request_with_500(make_stack):
    stack = make_stack(plan=lambda req: Plan("some words here", error_after=1))
    with pytest.raises(openai.InternalServerError) as info:
        stack.client().completions.create(model="smol-test", prompt="x", max_tokens=50)
    assert info.value.status_code == 500 and info.value.code == "generation_error"


def test_a_request_with_no_events_ends_with_an_error_after_the_timeout(make_stack):
    stack = make_stack(event_timeout_s=0.3, admitting=False)
    with pytest.raises(openai.InternalServerError, match="no token"):
        stack.client().completions.create(model="smol-test", prompt="x", max_tokens=5)


def test_the_stop_token_that_ends_a_request_adds_no_text(make_stack, tokenizer):
    stack = make_stack(plan=lambda req: Plan("Hello world"))
    (bang,) = tokenizer.encode("!", add_special_tokens=False)
    r = stack.client().completions.create(model="smol-test", prompt="x", max_tokens=20, extra_body={"stop": [bang]})
    assert stack.fake.received[0].sampling.stop_token_ids == [bang]
    assert r.choices[0].text == "Hello world" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(tokenizer.encode("Hello world", add_special_tokens=False)) + 1

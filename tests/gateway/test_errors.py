"""Every rejection has its HTTP status and an OpenAI-shaped body, and queues nothing."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.gateway_fakes import MAX_MODEL_LEN, Plan


def error_of(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.fixture
def stack(make_stack):
    s = make_stack()
    yield s
    assert s.fake.received == [], "a rejected request must not be queued"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -5}, "top_k"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "max_tokens": 5, "min_tokens": 6}, "min_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [1, 10**9]}, "prompt"),
    ({}, "prompt"),
])
def test_invalid_parameters_get_400_naming_the_parameter(stack, body, param):
    resp = httpx.post(stack.url + "/v1/completions", json={"model": "smol-test", **body})
    assert resp.status_code == 400
    err = error_of(resp)
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_invalid_json_gets_400_not_422(stack):
    resp = httpx.post(stack.url + "/v1/completions", content=b"{not json",
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and error_of(resp)["code"] == "invalid_json"


def test_a_chat_without_messages_gets_400(stack):
    resp = httpx.post(stack.url + "/v1/chat/completions", json={"model": "smol-test", "messages": []})
    assert resp.status_code == 400 and error_of(resp)["param"] == "messages"


def test_the_openai_client_sees_a_bad_request_error(stack):
    with pytest.raises(openai.BadRequestError) as info:
        stack.client().completions.create(model="smol-test", prompt="x", best_of=3)
    assert info.value.param == "best_of"


def test_prompt_plus_max_tokens_over_the_context_is_context_length_exceeded(stack, tokenizer):
    prompt = "word " * 100
    n_prompt = len(tokenizer.encode(prompt))
    with pytest.raises(openai.BadRequestError) as info:
        stack.client().completions.create(model="smol-test", prompt=prompt, max_tokens=MAX_MODEL_LEN - n_prompt + 1)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"


def test_a_prompt_that_fills_the_context_is_context_length_exceeded(stack):
    with pytest.raises(openai.BadRequestError) as info:
        stack.client().chat.completions.create(
            model="smol-test", messages=[{"role": "user", "content": "word " * MAX_MODEL_LEN}])
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"


def test_unknown_paths_are_404_in_the_openai_shape(stack):
    resp = httpx.get(stack.url + "/v1/nothing")
    assert resp.status_code == 404 and error_of(resp)["type"] == "not_found_error"


def test_a_full_queue_gets_429_with_retry_after(make_stack):
    stack = make_stack(max_queue_depth=2, admitting=False)
    stack.prefill(2)
    resp = httpx.post(stack.url + "/v1/completions", json={"model": "smol-test", "prompt": "x"})
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    assert error_of(resp)["code"] == "queue_full"
    with pytest.raises(openai.RateLimitError):
        stack.client().completions.create(model="smol-test", prompt="x")
    stack.fake.admitting = True  # the queue drains: accepted again
    stack.fake.plan = lambda req: Plan("ok")
    r = stack.client().completions.create(model="smol-test", prompt="x", max_tokens=5)
    assert r.choices[0].text == "ok"


def test_with_an_api_key_requests_without_it_get_401(make_stack):
    stack = make_stack(api_key="s3cret")
    with pytest.raises(openai.AuthenticationError) as info:
        stack.client("wrong").models.list()
    assert info.value.code == "invalid_api_key"
    assert httpx.post(stack.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    assert stack.client("s3cret").completions.create(model="smol-test", prompt="x", max_tokens=3).choices
    assert httpx.get(stack.url + "/health").status_code == 200  # probes need no key

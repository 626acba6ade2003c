"""The OpenAI parameters clients use, at the gateway (fake scheduler, real uvicorn, the real
`openai` client): n choices, lists of prompts and token-id prompts, logprobs in both shapes,
streamed and not, the parameters forwarded to the scheduler, unknown models (404), oversized
bodies (413) and draining (503)."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.support.gateway_fakes import Plan

MODEL = "smol-test"


@pytest.fixture
def stack(make_stack):
    return make_stack(plan=lambda req: Plan("Hello world!"))


def test_n_choices_are_separate_requests_sharing_the_prompt_with_their_own_seeds(stack):
    r = stack.client().completions.create(model=MODEL, prompt="Say hi", n=3, max_tokens=50, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.text == "Hello world!" and c.finish_reason == "stop" for c in r.choices)
    first, *others = stack.fake.received
    assert [q.sampling.seed for q in stack.fake.received] == [7, 8, 9]
    assert all(q.share_prompt_with == first.req_id and q.prompt_token_ids == first.prompt_token_ids
               for q in others)
    assert first.share_prompt_with is None
    assert r.usage.prompt_tokens == len(first.prompt_token_ids)     # the prompt counted once
    assert r.usage.completion_tokens == 3 * r.usage.completion_tokens // 3 > 0


def test_streamed_n_choices_each_end_with_their_finish_reason(stack):
    chunks = list(stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=50, stream=True))
    texts = {0: "", 1: ""}
    reasons = {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == {0: "Hello world!", 1: "Hello world!"} and reasons == {0: "stop", 1: "stop"}


def test_a_list_of_prompts_and_token_id_prompts_give_one_choice_each(stack, tokenizer):
    r = stack.client().completions.create(model=MODEL, prompt=["one", "two"], n=2, max_tokens=50)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    got = [q.prompt_token_ids for q in stack.fake.received]
    assert got[0] == got[1] == tokenizer.encode("one") and got[2] == got[3] == tokenizer.encode("two")
    stack.client().completions.create(model=MODEL, prompt=[[5, 6, 7], [8]], max_tokens=50)
    assert [q.prompt_token_ids for q in stack.fake.received[4:]] == [[5, 6, 7], [8]]


def test_sampling_parameters_reach_the_scheduler(stack):
    stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=9,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=3, stop=["x", "y"], logprobs=True,
        top_logprobs=4, extra_body={"repetition_penalty": 1.2, "min_tokens": 2})
    p = stack.fake.received[-1].sampling
    assert (p.max_tokens, p.presence_penalty, p.frequency_penalty, p.seed, p.repetition_penalty,
            p.min_tokens, p.logprobs) == (9, 0.5, -0.5, 3, 1.2, 2, 4)


def test_chat_logprobs_streamed_and_not(stack, tokenizer):
    c = stack.client()
    msgs = [{"role": "user", "content": "hi"}]
    whole = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=50, logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    ids = tokenizer.encode("Hello world!", add_special_tokens=False)
    assert "".join(e.token for e in content) == "Hello world!" and len(content) == len(ids)
    assert [e.logprob for e in content] == pytest.approx([-0.25 * (i + 1) for i in range(len(ids))])
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in content)
    assert content[0].bytes == list(content[0].token.encode())
    streamed = [e for ch in c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=50, logprobs=True,
                                                      stream=True)
                for choice in ch.choices if choice.logprobs for e in choice.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert all(e.top_logprobs == [] for e in streamed)
    plain = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=50)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_have_the_legacy_shape(stack):
    r = stack.client().completions.create(model=MODEL, prompt="x", max_tokens=50, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text == "Hello world!"
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert len(lp.token_logprobs) == len(lp.tokens) and all(len(d) == 2 for d in lp.top_logprobs)
    streamed = [ch.choices[0].logprobs for ch in stack.client().completions.create(
        model=MODEL, prompt="x", max_tokens=50, logprobs=0, stream=True) if ch.choices and ch.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_an_unknown_model_is_404_model_not_found(stack):
    with pytest.raises(openai.NotFoundError) as e:
        stack.client().completions.create(model="gpt-x", prompt="x")
    assert e.value.code == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        stack.client().chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "x"}])
    assert stack.client().models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        stack.client().models.retrieve("gpt-x")
    assert stack.fake.received == []


def test_a_body_over_the_limit_is_413_in_the_openai_shape(make_stack):
    stack = make_stack(max_body_bytes=1000)
    r = httpx.post(stack.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 2000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():
        yield b'{"model": "smol-test", "prompt": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'"}'

    r = httpx.post(stack.url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(stack.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3}
                      ).status_code == 200
    assert stack.fake.received and all(len(q.prompt_token_ids) < 10 for q in stack.fake.received)


def test_draining_refuses_new_requests_and_lets_started_ones_finish(make_stack):
    stack = make_stack(plan=lambda req: Plan("a b c d e f g h", interval_s=0.05))
    serving = stack.server.server.config.app.state.serving

    async def run():
        async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0) as c:
            started = asyncio.create_task(c.completions.create(model=MODEL, prompt="x", max_tokens=50))
            while not serving.active:
                await asyncio.sleep(0.01)
            serving.draining = True
            async with httpx.AsyncClient() as h:
                ready = await h.get(stack.url + "/ready")
                refused = await h.post(stack.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
            return await started, ready, refused

    done, ready, refused = asyncio.run(run())
    assert done.choices[0].text == "a b c d e f g h" and done.choices[0].finish_reason == "stop"
    assert ready.status_code == 503 and "draining" in ready.json()["reason"]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    assert len(stack.fake.received) == 1

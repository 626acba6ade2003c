"""The gateway's OpenAI API, driven by the real `openai` client against a real uvicorn server;
the scheduler is a scripted fake on the real queue (in-process, and Redis where it matters)."""
from __future__ import annotations

import pytest

from tests.support.gateway_fakes import Plan

REPLY = "Hi 🎉 日本語 there, wörld!"  # multi-byte characters split over byte-level BPE tokens


def test_models_list_names_the_served_model(make_stack):
    stack = make_stack(model_name="smol-served")
    models = stack.client().models.list().data
    assert [m.id for m in models] == ["smol-served"]


@pytest.mark.parametrize("backend", ["local", "redis"])
def test_completion_returns_the_generated_text_and_usage(make_stack, tokenizer, backend):
    stack = make_stack(backend, plan=lambda req: Plan(REPLY))
    r = stack.client().completions.create(model="smol-test", prompt="Say hi", max_tokens=50)
    n_reply = len(tokenizer.encode(REPLY, add_special_tokens=False)) + 1  # + EOS
    assert r.choices[0].text == REPLY
    assert r.choices[0].finish_reason == "stop"
    assert r.object == "text_completion" and r.model == "smol-test"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tokenizer.encode("Say hi")), n_reply)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert stack.fake.received[0].prompt_token_ids == tokenizer.encode("Say hi")


@pytest.mark.parametrize("backend", ["local", "redis"])
def test_streamed_completion_chunks_concatenate_to_the_text_without_broken_characters(make_stack, backend):
    stack = make_stack(backend, plan=lambda req: Plan(REPLY))
    chunks = list(stack.client().completions.create(model="smol-test", prompt="Say hi", max_tokens=50, stream=True))
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == REPLY
    assert not any("\ufffd" in t for t in texts)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"


def test_sampling_parameters_reach_the_scheduler(make_stack):
    stack = make_stack()
    stack.client().completions.create(model="smol-test", prompt="x", max_tokens=7, temperature=0.5, top_p=0.9,
                                      seed=42, stop=["\n\n"], extra_body={"top_k": 5, "stop_token_ids": [13]})
    s = stack.fake.received[0].sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop_token_ids) == (7, 0.5, 0.9, 5, 42, [13])


def test_max_tokens_defaults_to_a_cap_and_cuts_with_finish_reason_length(make_stack):
    stack = make_stack(plan=lambda req: Plan("one two three four five six"), default_max_tokens=3)
    r = stack.client().completions.create(model="smol-test", prompt="count")
    assert stack.fake.received[0].sampling.max_tokens == 3
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert r.choices[0].text == "one two three"


def test_a_token_id_prompt_is_accepted_as_is(make_stack):
    stack = make_stack()
    stack.client().completions.create(model="smol-test", prompt=[1, 2, 3], max_tokens=5)
    assert stack.fake.received[0].prompt_token_ids == [1, 2, 3]


def test_chat_completion_applies_the_chat_template(make_stack, tokenizer):
    stack = make_stack(plan=lambda req: Plan(REPLY))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    r = stack.client().chat.completions.create(model="smol-test", messages=messages, max_tokens=50)
    assert stack.fake.received[0].prompt_token_ids == tokenizer.encode_chat(messages)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == REPLY
    assert r.usage.prompt_tokens == len(tokenizer.encode_chat(messages))


@pytest.mark.parametrize("backend", ["local", "redis"])
def test_streamed_chat_with_include_usage_ends_with_a_usage_chunk(make_stack, tokenizer, backend):
    stack = make_stack(backend, plan=lambda req: Plan(REPLY))
    chunks = list(stack.client().chat.completions.create(
        model="smol-test", messages=[{"role": "user", "content": "Hello?"}], max_tokens=50, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
    assert chunks[-2].choices[0].finish_reason == "stop"
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.completion_tokens == len(tokenizer.encode(REPLY, add_special_tokens=False)) + 1
    assert usage.prompt_tokens == len(stack.fake.received[0].prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_concurrent_streams_each_get_their_own_text(make_stack):
    import concurrent.futures

    stack = make_stack("redis", plan=lambda req: Plan(f"answer number {req.prompt_token_ids[-1]} done",
                                                      interval_s=0.005))
    client = stack.client()

    def one(i: int) -> tuple[int, str]:
        stream = client.completions.create(model="smol-test", prompt=[i + 10], max_tokens=30, stream=True)
        return i, "".join(c.choices[0].text for c in stream)

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, range(24)))
    assert all(text == f"answer number {i + 10} done" for i, text in results)

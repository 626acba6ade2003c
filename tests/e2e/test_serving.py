"""End to end, as a user sees it: the real `openai` client (max_retries=0) against a real uvicorn
gateway on a free port, the real scheduler and a real SmolLM2 worker over ZeroMQ, in both
deployments: embedded (one process tree; in-process queue, or Redis given a URL) and
distributed (three processes, Redis). Expected tokens come from the offline engine (sarathi.llm.LLM) on the same
prompts,
greedy. max_tokens stay small so the suite fits in a few minutes on 2 CPU cores.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import openai
import pytest
import redis

from shared.model_source import resolve_model
from shared.sampling import SamplingParams
from tests.support.e2e_stack import MAX_MODEL_LEN, NUM_BLOCKS, DistributedStack, EmbeddedStack, get, metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a color."}]
CONCURRENT = [f"Request {i}: the number after {i} is" for i in range(64)]
KILLED = [f"Story {i}: once upon a time, in a land far away," for i in range(16)]
TOKENS = {PROMPT: 8, **{p: 4 for p in CONCURRENT}, **{p: 24 for p in KILLED}}
MODEL = resolve_model(None).name  # what the stacks serve; any other name is 404
PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3)
SECOND = "The largest ocean on Earth is"


@pytest.fixture(scope="module")
def offline():
    """prompt -> greedy completion text of the offline engine; "chat" -> the chat answer."""
    from sarathi.llm import LLM

    llm = LLM(num_blocks=512)
    prompts = list(TOKENS)
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=TOKENS[p]) for p in prompts])
    ref = {p: o.text for p, o in zip(prompts, outs)}
    ref["chat"] = llm.chat([CHAT], SamplingParams(temperature=0.0, max_tokens=8))[0].text
    ref["chat_lp"] = llm.chat([CHAT], SamplingParams(temperature=0.0, max_tokens=8, logprobs=3))[0].output
    ref["lp"] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, logprobs=2))[0].output
    ref["penalised"] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, **PENALTIES))[0].text
    ref["plain12"] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12))[0].text
    ref["second"] = llm.generate([SECOND], SamplingParams(temperature=0.0, max_tokens=6))[0].text
    ref["seeded"] = [llm.generate([PROMPT], SamplingParams(temperature=0.9, max_tokens=8, seed=11 + j))[0].text
                     for j in range(2)]
    ref["min_tokens"] = llm.chat([CHAT], SamplingParams(temperature=0.0, max_tokens=48, min_tokens=48))[0]
    # the default CPU path (the GGUF's own blocks, bf16 KV) stops after 38 tokens here: a 48-token window
    ref["chat48"] = llm.chat([CHAT], SamplingParams(temperature=0.0, max_tokens=48))[0]
    ref["tokenizer"] = llm.tokenizer
    return ref


@pytest.fixture(scope="module", params=["embedded", "embedded-redis", "distributed-redis", "embedded-async"])
def stack(request, tmp_path_factory, redis_server_url):
    """embedded: in-process queue. embedded-redis: the same command given a Redis URL.
    distributed-redis: worker, scheduler and gateway as separate processes (as in compose/k8s).
    embedded-async: `sarathi serve --async-scheduling` (every answer must still be the offline
    engine's)."""
    tmp = tmp_path_factory.mktemp(request.param)
    prefix = f"test:e2e:{uuid.uuid4().hex[:8]}:"
    if request.param == "distributed-redis":
        s = DistributedStack(tmp, redis_server_url, prefix)
    elif request.param == "embedded-async":
        s = EmbeddedStack(tmp, None, prefix, async_scheduling=True)
    else:
        s = EmbeddedStack(tmp, redis_server_url if request.param == "embedded-redis" else None, prefix)
    s.plans_ahead = request.param == "embedded-async"
    yield s
    s.close()
    r = redis.Redis.from_url(redis_server_url)
    keys = list(r.scan_iter(match=prefix + "*"))
    if keys:
        r.delete(*keys)


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


def test_models_list_names_the_served_model(stack):
    (model,) = client(stack).models.list().data
    assert model.id.startswith("SmolLM2-135M-Instruct")


def test_the_worker_log_says_which_backend_and_kernels_run(stack):
    """An operator reads the worker's start-up line in its log (in every mode: `sarathi worker`
    alone too): the device, attention, linear path and which kernel build runs and why."""
    from worker_svc.backends.cpu import native

    line = next((ln for ln in stack.logs[0].read_text().splitlines() if "worker backend: device cpu" in ln), None)
    assert line is not None, stack.logs[0].read_text()[-2000:]
    if native.available():
        assert "attention native" in line and "kernels:" in line and native.build_note() in line


def test_the_scheduler_log_says_whether_it_plans_batches_ahead(stack):
    lines = [ln for log in stack.logs if log.exists() for ln in log.read_text().splitlines()
             if "scheduler ready:" in ln]
    assert lines and all(("async scheduling" in ln) == stack.plans_ahead for ln in lines)


def test_greedy_completion_equals_the_offline_engine(stack, offline):
    r = client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text == offline[PROMPT]
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0


def test_streamed_completion_with_include_usage_ends_with_a_usage_chunk(stack, offline):
    chunks = list(client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline[PROMPT]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_completion_streamed_and_not_give_the_offline_answer(stack, offline):
    c = client(stack)
    whole = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert whole.choices[0].message.content == offline["chat"]
    assert whole.usage.completion_tokens == 8
    stream = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == offline["chat"]


def test_over_long_prompt_is_rejected_with_context_length_exceeded(stack):
    with pytest.raises(openai.BadRequestError) as err:
        client(stack).completions.create(model=MODEL, prompt="hello " * MAX_MODEL_LEN, max_tokens=8)
    assert err.value.code == "context_length_exceeded"


def test_64_concurrent_streaming_clients_each_get_their_own_tokens(stack, offline):
    async def one(c: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                                      timeout=180) as c:
            return await asyncio.gather(*(one(c, p) for p in CONCURRENT))

    texts = asyncio.run(all_of_them())
    assert texts == [offline[p] for p in CONCURRENT]


def test_a_client_disconnect_aborts_the_request_and_frees_its_kv_blocks(stack):
    url = stack.scheduler_metrics_url
    before = get(url)[1]
    stream = client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=500, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()  # the client goes away mid-stream
    closed_at = metric(get(url)[1], "sarathi_scheduler_iteration_seconds_count")
    deadline = time.monotonic() + 30
    while True:
        text = get(url)[1]
        if metric(text, "sarathi_scheduler_kv_free_blocks") == NUM_BLOCKS and \
                metric(text, "sarathi_scheduler_running_requests") == 0:
            break
        assert time.monotonic() < deadline, "the disconnected request still holds KV blocks"
        time.sleep(0.02)
    aborted = 'sarathi_scheduler_requests_finished_total'
    assert metric(text, aborted, '{reason="abort"}') == metric(before, aborted, '{reason="abort"}') + 1
    # the abort took effect at a step boundary: the request ran at most the iteration that was
    # in flight when the gateway sent it, and one more that may have started meanwhile
    assert metric(text, "sarathi_scheduler_iteration_seconds_count") - closed_at <= 2


def test_metrics_have_latency_histograms_and_finish_reasons(stack):
    list(client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True))
    text = "".join(get(u)[1] for u in stack.metrics_urls)
    for name in ("sarathi_gateway_time_to_first_token_seconds", "sarathi_gateway_inter_token_latency_seconds",
                 "sarathi_gateway_queue_time_seconds", "sarathi_gateway_e2e_request_latency_seconds"):
        assert metric(text, name + "_count") > 0, name
        assert f"{name}_bucket{{le=" in text
    assert metric(text, "sarathi_gateway_requests_finished_total", '{reason="length"}') > 0
    for name in ("sarathi_scheduler_running_requests", "sarathi_scheduler_waiting_requests",
                 "sarathi_scheduler_kv_cache_usage_ratio", "sarathi_scheduler_preemptions_total",
                 "sarathi_scheduler_token_budget"):
        assert name in text, name
    assert metric(text, "sarathi_scheduler_tokens_total", '{kind="decode"}') > 0


def test_sigkill_of_the_scheduler_with_16_in_flight_loses_and_duplicates_nothing(stack, offline):
    if stack.mode != "distributed-redis":
        pytest.skip("the scheduler is a separate process only in the distributed deployment")
    started = 0

    async def one(c: openai.AsyncOpenAI, prompt: str, first_token: asyncio.Event):
        nonlocal started
        text, reason = "", None
        try:
            stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True)
            async for ch in stream:
                if ch.choices:
                    if not text:
                        started += 1
                        if started == len(KILLED):
                            first_token.set()
                    text += ch.choices[0].text
                    reason = ch.choices[0].finish_reason or reason
        except openai.APIError as e:  # an explicit error event is an acceptable end
            return text, f"error: {e}"
        return text, reason

    async def run():
        first_token = asyncio.Event()
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                                      timeout=240) as c:
            tasks = [asyncio.create_task(one(c, p, first_token)) for p in KILLED]
            await asyncio.wait_for(first_token.wait(), 120)
            await asyncio.to_thread(stack.kill_and_restart_scheduler)
            return await asyncio.wait_for(asyncio.gather(*tasks), 240)  # none may hang

    results = asyncio.run(run())
    for prompt, (text, reason) in zip(KILLED, results):
        assert reason is not None, f"{prompt!r} ended without a finish reason"
        if reason.startswith("error"):
            assert offline[prompt].startswith(text)
        else:  # completed: exactly the offline tokens, so none was duplicated or lost
            assert text == offline[prompt] and reason == "length"
    assert sum(r == "length" for _, r in results) == len(KILLED)
    gateway_metrics = get(stack.metrics_urls[-1])[1]
    assert metric(gateway_metrics, "sarathi_gateway_duplicate_events_dropped_total") > 0


# -- the OpenAI parameters clients use (greedy ones against the offline engine) ------------------
def test_chat_logprobs_streamed_and_not_are_the_offline_engines(stack, offline):
    c = client(stack)
    ref = offline["chat_lp"]
    tok = offline["tokenizer"]
    whole = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                      top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert [e.token for e in content] == [tok.decode([t], skip_special_tokens=False) for t in ref.output_token_ids]
    assert [e.logprob for e in content] == pytest.approx([lp[0] for lp in ref.logprobs], abs=2e-3)
    for e, lp in zip(content, ref.logprobs):
        assert [t.token for t in e.top_logprobs] == [tok.decode([t], skip_special_tokens=False) for t in lp[1]]
        assert e.top_logprobs[0].logprob >= e.logprob - 1e-6  # greedy: the chosen one is the top one
    stream = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3, stream=True)
    streamed = [e for ch in stream for ch_c in ch.choices if ch_c.logprobs for e in ch_c.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_completion_logprobs_streamed_and_not_are_the_offline_engines(stack, offline):
    c = client(stack)
    ref = offline["lp"]
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == offline[PROMPT] == "".join(lp.tokens)
    assert lp.token_logprobs == pytest.approx([x[0] for x in ref.logprobs], abs=2e-3)
    assert all(len(d) == 2 for d in lp.top_logprobs)
    streamed = [t for ch in c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                                   logprobs=2, stream=True)
                if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_penalties_are_applied_as_the_offline_engine_does(stack, offline):
    r = client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                         presence_penalty=PENALTIES["presence_penalty"],
                                         frequency_penalty=PENALTIES["frequency_penalty"],
                                         extra_body={"repetition_penalty": PENALTIES["repetition_penalty"]})
    assert r.choices[0].text == offline["penalised"] != offline["plain12"]


def test_n_seeded_choices_are_the_offline_engines_with_seed_plus_index(stack, offline):
    r = client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.9, seed=11, n=2)
    assert [c.text for c in r.choices] == offline["seeded"]
    assert r.usage.completion_tokens == 16


def test_prompt_lists_token_id_prompts_and_stop_lists(stack, offline):
    c = client(stack)
    tok = offline["tokenizer"]
    r = c.completions.create(model=MODEL, prompt=[PROMPT, SECOND], max_tokens=6, temperature=0)
    assert r.choices[0].text and offline[PROMPT].startswith(r.choices[0].text)  # 6 of its 8 tokens
    assert r.choices[1].text == offline["second"]
    ids = c.completions.create(model=MODEL, prompt=[tok.encode(PROMPT), tok.encode(SECOND)], max_tokens=6,
                               temperature=0)
    assert [ch.text for ch in ids.choices] == [ch.text for ch in r.choices]
    word = offline[PROMPT].split()[1]
    cut = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=["zzz", word])
    assert cut.choices[0].text == offline[PROMPT][:offline[PROMPT].index(word)]
    assert cut.choices[0].finish_reason == "stop"


def test_min_tokens_and_max_completion_tokens(stack, offline):
    assert offline["chat48"].finish_reason == "stop"          # it would stop early on its own
    r = client(stack).chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                              max_completion_tokens=48, extra_body={"min_tokens": 48})
    assert r.usage.completion_tokens == 48 and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == offline["min_tokens"].text


def test_an_unknown_model_is_404_model_not_found(stack):
    with pytest.raises(openai.NotFoundError) as e:
        client(stack).chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    assert e.value.code == "model_not_found"

"""An open-loop load generator with two targets.

Workload: request lengths from a trace (sarathi.measure.trace), arrivals from a Poisson process at `qps`
(also gamma with a coefficient of variation, or fixed bursts), prompts of exactly the trace's
token count (random token ids from a seeded generator), outputs of exactly the trace's length
(greedy, `ignore_eos`). The same (trace, seed, qps, n) gives the same workload on every target.

Open loop: a request is due at its arrival time whether or not the target keeps up; its TTFT
and scheduling delay count from that time. The one exception, where the workload asks for it
(RequestSpec.after: chat turns sent after the answer they reply to), a follow-up is due no
earlier than its think time after that answer ended. The run stops at the last arrival + `drain_s`;
requests not finished by then stay in the results as misses (sarathi.measure.metrics).

Targets:
* run_inprocess(engine, ...): the real EngineLoop (scheduler + executor) driven directly, no
  HTTP. With the torch executor and the monotonic clock it measures the real engine; with a
  SimExecutor and a SimClock it simulates it (the clock jumps over idle time and advances by
  the cost model's iteration time), deterministically.
* run_http(url, ...): any OpenAI-compatible server, /v1/completions with streamed SSE; token
  times are the arrival times of the SSE chunks (httpx, asyncio).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from sarathi.measure.costmodel import aggregates, batch_shapes
from sarathi.measure.metrics import IterationRecord, RequestRecord
from sarathi.measure.trace import Trace
from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.sim_executor import SimClock
from shared.messages import Batch
from shared.sampling import SamplingParams

ARRIVALS = ("poisson", "gamma", "burst")


@dataclass
class RequestSpec:
    """arrival: seconds after the run starts; prompt_ids: exactly the trace's prompt length;
    max_tokens: the trace's output length (generated in full: EOS is ignored, unless
    ignore_eos is False: then the request may end earlier, at EOS, as a real answer does)."""

    req_id: str
    arrival: float
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool = True
    # a follow-up (make_chat_workload with ChatShape.wait_for_answer): sent no earlier than
    # think_s seconds after request `after` ended (every runner holds it until then), else at
    # arrival. An `after` that is not in the workload is no constraint.
    after: str | None = None
    think_s: float = 0.0


class FollowUps:
    """The runners' rule for follow-ups (RequestSpec.after), on the run's clock (the arrivals'):
    held(spec) says whether a spec waits for another one of the workload; due(spec, t) is when
    it goes out if the request it follows ended at t: max(arrival, t + think_s), or None when
    that is after the workload's last scheduled arrival (the arrivals stop there, so every
    request sent has the run's drain time to finish). A follow-up not sent (held at the end, or
    due too late) has no record: its predecessor's counts. The step-driven runners hand each
    step's events to released(), which puts the follow-ups now due into their pending queue."""

    def __init__(self, workload: list[RequestSpec]):
        ids = {s.req_id for s in workload}
        self.last = max((s.arrival for s in workload), default=0.0)
        self._held: dict[str, list[RequestSpec]] = {}
        for s in workload:
            if s.after is not None and s.after in ids:   # an `after` outside them: no constraint
                self._held.setdefault(s.after, []).append(s)
        self._waiting = {s.req_id for specs in self._held.values() for s in specs}

    def held(self, spec: RequestSpec) -> bool:
        return spec.req_id in self._waiting

    def due(self, spec: RequestSpec, t: float) -> float | None:
        at = max(spec.arrival, t + spec.think_s)
        return at if at <= self.last else None

    def released(self, events, t: float, pending: deque) -> int:
        """The step's events (TokenEvents, at clock t): the follow-ups of the requests that ended
        go into pending, kept sorted by arrival. Returns how many requests ended."""
        import dataclasses
        done = 0
        for e in events:
            if e.finish_reason is None:
                continue
            done += 1
            for s in self._held.pop(e.req_id, []):
                self._waiting.discard(s.req_id)
                at = self.due(s, t)
                if at is not None:
                    i = len(pending)
                    while i > 0 and pending[i - 1].arrival > at:
                        i -= 1
                    pending.insert(i, dataclasses.replace(s, arrival=at))
        return done


@dataclass
class RunResult:
    records: list[RequestRecord]
    iterations: list[IterationRecord]
    end_time: float           # run clock, seconds after start, when the run stopped waiting


def arrival_times(n: int, qps: float, process: str = "poisson", *, cv: float = 1.0,
                  burst_size: int = 8, rng: np.random.Generator | None = None) -> list[float]:
    """n arrival times (seconds, first at 0) at a mean rate of qps requests/s.
    poisson: exponential gaps; gamma: gamma gaps with coefficient of variation cv (cv = 1 is
    Poisson, > 1 burstier); burst: groups of burst_size at once, every burst_size/qps s."""
    if not qps > 0:
        raise ValueError(f"--qps must be > 0, got {qps}")
    if n < 1:
        raise ValueError(f"--num-requests must be >= 1, got {n}")
    rng = rng or np.random.default_rng(0)
    if process == "poisson":
        gaps = rng.exponential(1.0 / qps, n)
    elif process == "gamma":
        if not cv > 0:
            raise ValueError(f"--cv must be > 0, got {cv}")
        shape = 1.0 / cv ** 2
        gaps = rng.gamma(shape, 1.0 / (qps * shape), n)
    elif process == "burst":
        if burst_size < 1:
            raise ValueError(f"--burst-size must be >= 1, got {burst_size}")
        return [(i // burst_size) * burst_size / qps for i in range(n)]
    else:
        raise ValueError(f"unknown arrival process {process!r}; choose one of {', '.join(ARRIVALS)}")
    t = np.cumsum(gaps)
    return [float(x) for x in t - t[0]]


def make_workload(trace: Trace, num_requests: int, qps: float, *, arrival: str = "poisson",
                  cv: float = 1.0, burst_size: int = 8, seed: int = 0,
                  vocab_size: int = 32000) -> list[RequestSpec]:
    """num_requests requests drawn from the trace (without replacement while it lasts), with
    prompt ids uniform in [100, vocab_size) (ids below 100 hold most special tokens)."""
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(trace), size=num_requests, replace=num_requests > len(trace))
    times = arrival_times(num_requests, qps, arrival, cv=cv, burst_size=burst_size, rng=rng)
    low = min(100, vocab_size - 1)
    return [RequestSpec(f"r{i}", t, rng.integers(low, vocab_size, trace.prompt_lens[j]).tolist(),
                        trace.output_lens[j])
            for i, (j, t) in enumerate(zip(idx, times))]


@dataclass
class ChatShape:
    """Multi-turn chat conversations (make_chat_workload). system_prompts: distinct system prompts,
    shared across users (each conversation draws one); system_len: their length (tokens);
    turns: (min, max) turns per conversation, uniform; user_scale: a user turn's length is a
    trace prompt length x this; think_s: mean seconds between a turn's answer and the next turn
    (exponential), the answer's time estimated as answer_s_per_token x its length (the next
    turn's scheduled arrival). wait_for_answer: a turn is also sent no earlier than its think
    time after the answer before it ended (RequestSpec.after), as a user replies to an answer
    read; False (open loop): at its scheduled arrival even while that answer is still being
    generated, its tokens already in the prompt. warmup_s > 0:
    the workload also holds the turns arriving in the warmup_s seconds before 0 (negative
    arrivals; a simulation runs them to warm the caches and leaves them out of the results)."""

    system_prompts: int = 4
    system_len: int = 512
    turns: tuple[int, int] = (2, 8)
    user_scale: float = 0.25
    think_s: float = 5.0
    answer_s_per_token: float = 0.02
    warmup_s: float = 0.0
    wait_for_answer: bool = False

    @property
    def mean_turns(self) -> float:
        return (self.turns[0] + self.turns[1]) / 2


def sim_output_tokens(start: int, n: int, vocab_size: int) -> list[int]:
    """The tokens the simulated worker generates at positions start .. start + n - 1
    (sarathi.measure.simulate.SimulatedWorker: a function of the position only)."""
    return [1 + p % (vocab_size - 1) for p in range(start, start + n)]


def make_chat_workload(trace: Trace, num_requests: int, qps: float, shape: ChatShape | None = None, *,
                       seed: int = 0, vocab_size: int = 32000, max_total_len: int = 8192) -> list[RequestSpec]:
    """num_requests requests of multi-turn conversations at a mean of qps requests/s (arrival
    order, the first at 0). Turn k + 1's prompt is turn k's prompt + turn k's answer + a new user
    message, so consecutive turns share a growing prefix, and every prompt starts with one of the
    shared system prompts. The answer tokens are the simulated worker's (sim_output_tokens): in
    simulation a follow-up's prefix is exactly what the replica that served turn k computed;
    against a real server a follow-up carries these tokens instead of the real answer (its earlier
    prompt still matches). Turn k + 1 arrives answer time + think time after turn k (open loop:
    whether or not turn k has ended). A conversation ends early when the next prompt + answer
    would exceed max_total_len. With shape.wait_for_answer, turn k + 1 also waits for turn k's
    end (RequestSpec.after; the runners hold it).

    Stationary from the start: conversations begin (Poisson) long enough before 0 that the run
    opens mid-stream, with follow-ups of older conversations; only turns arriving at or after
    -shape.warmup_s are kept (num_requests of them at or after 0). Arrival times are then scaled
    so that the mean rate is exactly qps (conversations cut short by max_total_len have fewer
    turns than the nominal mean). Request ids: c<conversation>t<turn>."""
    shape = shape or ChatShape()
    if not qps > 0:
        raise ValueError(f"--qps must be > 0, got {qps}")
    if num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    low = min(100, vocab_size - 1)
    systems = [rng.integers(low, vocab_size, shape.system_len).tolist() for _ in range(shape.system_prompts)]
    rate = qps / shape.mean_turns
    mean_out = float(np.mean(trace.output_lens))
    warmup = shape.warmup_s + shape.turns[1] * (mean_out * shape.answer_s_per_token + shape.think_s)
    horizon = 1.5 * num_requests / qps + 10.0
    out: list[RequestSpec] = []
    t, c = -warmup, 0
    while t < horizon or sum(1 for s in out if s.arrival >= 0) < num_requests:
        prompt = list(systems[int(rng.integers(len(systems)))])
        arrival, think = t, 0.0
        for k in range(int(rng.integers(shape.turns[0], shape.turns[1] + 1))):
            j = int(rng.integers(len(trace)))
            user = max(1, round(trace.prompt_lens[j] * shape.user_scale))
            answer = trace.output_lens[j]
            if len(prompt) + user + answer > max_total_len:
                break
            prompt = prompt + rng.integers(low, vocab_size, user).tolist()
            if arrival >= -shape.warmup_s:
                after = f"c{c}t{k - 1}" if k and shape.wait_for_answer else None
                out.append(RequestSpec(f"c{c}t{k}", arrival, prompt, answer, after=after, think_s=think))
            prompt = prompt + sim_output_tokens(len(prompt), answer, vocab_size)
            think = float(rng.exponential(shape.think_s))
            arrival += answer * shape.answer_s_per_token + think
        c += 1
        t += float(rng.exponential(1.0 / rate))
    out.sort(key=lambda s: s.arrival)
    warm = [s for s in out if s.arrival < 0]
    out = out[len(warm):len(warm) + num_requests]
    t0, span = out[0].arrival, out[-1].arrival - out[0].arrival
    scale = (len(out) - 1) / qps / span if span > 0 and len(out) > 1 else 1.0
    for s in warm + out:
        s.arrival = (s.arrival - t0) * scale
        s.think_s *= scale
    return warm + out


def shift_prompts(workload: list[RequestSpec], scale: float, *, max_total_len: int,
                  vocab_size: int = 32000, seed: int = 0) -> list[RequestSpec]:
    """A workload whose prompts change length mid-run: requests arriving in the second half of
    the arrival span get prompts `scale` x as long (rounded, >= 1, prompt + output kept within
    max_total_len tokens), outputs unchanged. For the adaptive token budget's step change."""
    if not workload or not scale > 0:
        raise ValueError(f"--shift-prompt-scale must be > 0, got {scale}")
    rng = np.random.default_rng(seed + 1)
    mid = workload[-1].arrival / 2
    low = min(100, vocab_size - 1)
    out = []
    for s in workload:
        if s.arrival >= mid:
            n = max(1, min(round(len(s.prompt_ids) * scale), max_total_len - s.max_tokens))
            s = RequestSpec(s.req_id, s.arrival, rng.integers(low, vocab_size, n).tolist(), s.max_tokens)
        out.append(s)
    return out


def bench_sampling(max_tokens: int, ignore_eos: bool = True) -> SamplingParams:
    """Greedy, exactly max_tokens tokens: the trace's output length, whatever the model says
    (ignore_eos False: at most max_tokens, ending at EOS)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


# -- in-process ---------------------------------------------------------------------------------
def run_inprocess(engine: EngineLoop, workload: list[RequestSpec], *, drain_s: float,
                  on_progress: Callable[[int], None] | None = None) -> RunResult:
    """Drive the engine through the workload, one engine.step() (one iteration) at a time.

    The scheduler's clock is the run's clock: a SimClock is advanced over idle gaps (and by
    the executor's cost model); any other clock is waited on with time.sleep. on_progress(n)
    is called with the number of requests that finished in each iteration."""
    sched, clock = engine.scheduler, engine.scheduler.clock
    sim = isinstance(clock, SimClock)
    t0 = clock()
    end = t0 + max((s.arrival for s in workload), default=0.0) + drain_s
    follow = FollowUps(workload)    # follow-ups wait for the answer before them (ChatShape)
    pending = deque(sorted((s for s in workload if not follow.held(s)), key=lambda s: s.arrival))
    reqs, iterations = {}, []
    # (batch, seconds it ran, clock at its end) of the batch engine.step() ran, if it ran one
    collected: list[tuple[Batch, float, float]] = []
    chained = engine.on_batch

    def on_batch(batch: Batch, output, seconds: float) -> None:
        collected.append((batch, seconds, clock()))
        if chained is not None:
            chained(batch, output, seconds)

    engine.on_batch = on_batch
    try:
        while True:
            now = clock()
            while pending and t0 + pending[0].arrival <= now:
                spec = pending.popleft()
                reqs[spec.req_id] = (spec, engine.add_request(
                    spec.req_id, spec.prompt_ids, bench_sampling(spec.max_tokens, spec.ignore_eos),
                    t0 + spec.arrival))
            if now >= end:
                break
            collected.clear()
            started = clock()
            events = engine.step()          # raises StalledError when nothing can ever run
            done = follow.released(events, clock() - t0, pending)
            if done and on_progress:
                on_progress(done)
            if collected:
                # a SimClock moved by the executor's cost; a real clock: the execution alone
                # (seconds from submit to collect), not the scheduling around it
                batch, seconds, ended = collected[0]
                duration = ended - started if sim else seconds
                started = ended - duration
                tokens, kv, pairs, seqs = aggregates(batch_shapes(batch))
                decodes = sum(1 for s in batch.seqs if s.is_decode)
                iterations.append(IterationRecord(started - t0, duration, tokens - decodes, decodes,
                                                  seqs, kv, pairs))
            elif not sched.has_unfinished():   # idle: on to the next arrival
                if not pending:
                    break
                wake = min(t0 + pending[0].arrival, end)
                if sim:
                    clock.now = max(clock.now, wake)
                else:
                    time.sleep(max(0.0, wake - clock()))
    finally:
        engine.on_batch = chained
    records = []
    for spec, req in reqs.values():
        records.append(_record(spec, t0, [t - t0 for t in req.token_times],
                               None if req.first_scheduled_time is None
                               else req.first_scheduled_time - t0,
                               req.finish_reason in ("stop", "length"), req.error))
    for spec in pending:  # due after the run stopped (only when drain_s < 0): still misses
        records.append(_record(spec, t0, [], None, False, None))
    return RunResult(records, iterations, clock() - t0)


def _record(spec: RequestSpec, t0: float, token_times: list[float], first_scheduled,
            finished: bool, error: str | None) -> RequestRecord:
    return RequestRecord(spec.req_id, spec.arrival, len(spec.prompt_ids), spec.max_tokens,
                         token_times, first_scheduled, finished, error)


# -- HTTP ---------------------------------------------------------------------------------------
class TargetUnreachable(ValueError):
    """The URL does not answer as an OpenAI-compatible server."""


async def probe_server(client, url: str) -> str:
    """The first model id the server lists at /v1/models; TargetUnreachable otherwise."""
    import httpx

    try:
        r = await client.get("/v1/models", timeout=10.0)
    except httpx.HTTPError as e:
        raise TargetUnreachable(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise TargetUnreachable(f"{url}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise TargetUnreachable(f"{url}/v1/models did not list a model: {r.text[:200]}") from None


def run_http(url: str, workload: list[RequestSpec], *, drain_s: float, model: str | None = None,
             api_key: str | None = None, extra_body: dict | None = None,
             on_progress: Callable[[int], None] | None = None) -> RunResult:
    """Send the workload to url's /v1/completions (token-id prompts, greedy, stream, each
    request's ignore_eos; extra_body: more fields for every request) at the arrival times;
    record each SSE chunk's arrival time. Raises TargetUnreachable if the server does not
    answer /v1/models."""
    return asyncio.run(_run_http(url.rstrip("/"), workload, drain_s, model, api_key, on_progress,
                                 extra_body or {}))


async def _run_http(url, workload, drain_s, model, api_key, on_progress, extra_body) -> RunResult:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None, limits=limits) as client:
        model = model or await probe_server(client, url)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        records = [_record(s, 0.0, [], None, False, None) for s in workload]
        follow = FollowUps(workload)
        ended = {s.req_id: asyncio.Event() for s in workload}
        ended_at: dict[str, float] = {}
        sent: set[str] = set()

        async def one(spec: RequestSpec, rec: RequestRecord) -> None:
            try:
                await send(spec, rec)
            finally:
                ended_at[spec.req_id] = loop.time() - t0
                ended[spec.req_id].set()

        async def send(spec: RequestSpec, rec: RequestRecord) -> None:
            if follow.held(spec):   # a follow-up: after that answer
                await ended[spec.after].wait()
                at = follow.due(spec, ended_at[spec.after])
                if at is None:
                    return
                rec.arrival = at
            await asyncio.sleep(max(0.0, t0 + rec.arrival - loop.time()))
            sent.add(spec.req_id)
            body = {"model": model, "prompt": spec.prompt_ids, "max_tokens": spec.max_tokens,
                    "temperature": 0.0, "stream": True, "ignore_eos": spec.ignore_eos, **extra_body}
            try:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                        return
                    async for line in r.aiter_lines():
                        now = loop.time() - t0
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        choices = json.loads(data).get("choices") or []
                        if not choices:
                            continue
                        if choices[0].get("text"):
                            rec.token_times.append(now)
                        if choices[0].get("finish_reason"):
                            rec.finished = choices[0]["finish_reason"] in ("stop", "length")
            except httpx.HTTPError as e:
                rec.error = f"{type(e).__name__}: {e}"
            if rec.finished and on_progress:
                on_progress(1)

        tasks = [asyncio.create_task(one(s, r)) for s, r in zip(workload, records)]
        end = max((s.arrival for s in workload), default=0.0) + drain_s
        _, late = await asyncio.wait(tasks, timeout=max(0.0, t0 + end - loop.time()))
        for t in late:  # still streaming at the end of the run: unfinished, cut off here
            t.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        # a follow-up never sent (due too late, or its answer never came) has no record
        kept = [r for s, r in zip(workload, records) if not follow.held(s) or s.req_id in sent]
        return RunResult(kept, [], loop.time() - t0)

"""`sarathi simulate`: the unchanged scheduler (Scheduler + EngineLoop, every policy, PP
micro-batches in flight, preemption, prefix caching) against a simulated worker on a virtual
clock. Discrete-event: nothing sleeps; the clock jumps from one event to the next.

* SimulatedWorker: a pipeline of `stages` stages behind the EngineLoop's submit/collect seam.
  A submitted batch enters stage 0 when stage 0 is free, each later stage when the batch left
  the one before and that stage is free (stage times from the cost model: a GPUCostModel's
  stage_times, or one stage of a CPU CostModel); collect() moves the clock to the batch's end.
  Sampled tokens are a function of the position (runs ignore EOS: only lengths matter).
* Replicas: each replica is one scheduler + its worker with its own clock. Arrivals are routed
  when every busy replica's clock has reached them; the replica with the earliest clock steps
  next. A replica sees a request at its next iteration boundary, as the real scheduler does;
  with one replica this is run_inprocess. Routing (sarathi.measure.routing): least-unfinished
  (the default: the replica with the fewest unfinished requests, ties the lowest index), the
  shared queue's pull, or the inference gateway's endpoint picker's scorers.
* KV tier: replicas may share a KVTier (host memory or a KV store, as LMCache or Mooncake run
  one): every block computed is written to it, and a replica loads what its own cache lacks
  from it (TieredBlockManager) over its worker's KV link, before the batch or beside it.

Pipeline parallelism, two measures over stages and replicas:
* pp_idle_fraction: the share of stage time a stage is idle while its replica has unfinished
  requests (busy periods only): every bubble, including a pipeline the policy cannot fill (a policy
  that puts every decode in one micro-batch leaves the other stages waiting);
* pp_bubble_fraction: only the idle time between two batches where the stage waits for an earlier
  stage to hand over a batch that had already entered the pipeline (uneven micro-batch times), out
  of that time plus busy time.
"""
from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict, deque
from typing import Callable

import numpy as np

from sarathi.measure.costmodel import aggregates, batch_shapes
from sarathi.measure.loadgen import FollowUps, RequestSpec, RunResult, _record, bench_sampling
from sarathi.measure.metrics import IterationRecord, windowed_tbt_p99
from sarathi.measure.tools import Target
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sim_executor import SimClock
from shared.config import CacheConfig, ModelInfo, SchedulerConfig
from shared.messages import Batch, BatchOutput


class SimulatedWorker:
    """submit(batch) / collect() -> (batch, output): a pipelined worker on a SimClock.

    cost: an object with stage_times(batch) -> [seconds per stage] (GPUCostModel), or a callable
    batch -> seconds (one stage). noise_sigma > 0: each batch's times x exp(sigma z - sigma^2 / 2),
    z standard normal from a generator seeded with `seed` (mean 1; deterministic for a run).
    Keeps busy / bubble seconds per stage. spec_acceptance: speculative decoding's acceptance
    parameter: each draft token is accepted with this probability given the ones before it
    (seeded), so a decode with k drafts emits 1 + a geometric number of them, at most k.
    overlap_host (async scheduling): the host's share of a batch's first stage (the cost's
    host_s(batch): scheduling, input preparation, sampling launches) runs from when the batch is
    submitted, beside the batch before it, and only the rest occupies the device; without it
    (or with a cost that has no host_s) the whole stage time does, after the batch before."""

    def __init__(self, cost, clock: SimClock, block_size: int, vocab_size: int,
                 noise_sigma: float = 0.0, seed: int = 0, kv_bytes_per_token: int = 0,
                 kv_link_gbs: float = 25.0, spec_acceptance: float = 0.0, overlap_host: bool = False):
        self.cost, self.clock = cost, clock
        self.host_s: Callable[[Batch], float] | None = (
            cost.host_s if overlap_host and hasattr(cost, "host_s") else None)
        self.spec_acceptance = spec_acceptance
        self._spec_rng = np.random.default_rng(seed + 7919)
        self.block_size = block_size
        # KV transfer (prefill/decode disaggregation): a batch's KvSends move len(src_blocks) x
        # block_size x kv_bytes_per_token bytes over a kv_link_gbs GB/s link, one after another,
        # after the last stage; the worker waits for the ack, so its next batch starts after them
        self.kv_bytes_per_token, self.kv_link_gbs = kv_bytes_per_token, kv_link_gbs
        self.kv_s = 0.0          # seconds spent sending KV (s), not in busy
        # a KV tier (TieredBlockManager): the blocks a batch's allocations loaded from it
        # (loads() -> blocks since the last call) come over the same link, either before the
        # batch starts (load_overlap False: a synchronous load, LMCache's default) or layer by
        # layer beside its forward pass (True: each stage takes max(its compute, its share of
        # the load), the layer-wise pipelining of LMCache's layerwise mode)
        self.loads: Callable[[], int] | None = None
        self.load_overlap = False
        self.tier_load_s = 0.0           # seconds spent loading KV from a tier (s), not in busy
        self.noise_sigma = noise_sigma
        self._rng = np.random.default_rng(seed)
        self.stage_times: Callable[[Batch], list[float]] = (
            cost.stage_times if hasattr(cost, "stage_times") else (lambda b: [cost(b)]))
        self.vocab_size = vocab_size
        self.stage_free: list[float] | None = None      # when each stage is next free (s)
        self.busy: list[float] = []
        self.bubble: list[float] = []
        self._queue: deque[tuple[Batch, float, list[float]]] = deque()

    def submit(self, batch: Batch) -> None:
        times = self.stage_times(batch)
        host = self.host_s(batch) if self.host_s is not None else 0.0
        if self.noise_sigma > 0:   # iteration-to-iteration variation: lognormal, mean 1, seeded
            f = math.exp(self.noise_sigma * self._rng.standard_normal() - self.noise_sigma ** 2 / 2)
            times = [t * f for t in times]
            host *= f
        if self.stage_free is None:
            self.stage_free = [0.0] * len(times)
            self.busy, self.bubble = [0.0] * len(times), [0.0] * len(times)
        submitted = t = self.clock.now
        loaded = self.loads() if self.loads is not None else 0
        if loaded:                  # the tier's blocks, before or beside this batch's compute
            secs = self.kv_transfer(loaded)[1]
            self.tier_load_s += secs
            if self.load_overlap:
                times = [max(dt, secs / len(times)) for dt in times]
            else:
                t = max(t, self.stage_free[0]) + secs
        for s, dt in enumerate(times):
            if s == 0 and host:     # prepared on the host from the submit on, beside the batch before
                start, dt = max(t + host, self.stage_free[0]), dt - host
                self.busy[0] += host
            else:
                start = max(t, self.stage_free[s])
            if s > 0 and self.stage_free[s] > submitted:
                # the stage finished its last batch after this one entered the pipeline and then
                # waited for an earlier stage to hand it over (pipeline fill after idle is not a bubble)
                self.bubble[s] += max(0.0, start - self.stage_free[s])
            t = start + dt
            self.stage_free[s] = t
            self.busy[s] += dt
        sent = {}
        for send in batch.kv_sends:
            nbytes, secs = self.kv_transfer(len(send.src_blocks))
            sent[send.req_id] = {"kv_transfer_s": secs, "kv_bytes": nbytes}
            t += secs
            self.kv_s += secs
        self.stage_free[-1] = t
        self._queue.append((batch, t, times, submitted, sent))

    def kv_transfer(self, num_blocks: int) -> tuple[int, float]:
        """(bytes, seconds) of sending num_blocks KV blocks to another worker."""
        nbytes = num_blocks * self.block_size * self.kv_bytes_per_token
        return nbytes, nbytes / (self.kv_link_gbs * 1e9)

    def head_ready(self) -> bool:
        """The oldest batch has ended by the clock (a PoolSet collects only those)."""
        return bool(self._queue) and self._queue[0][1] <= self.clock.now

    @property
    def next_done(self) -> float:
        """When the oldest batch in flight ends (inf: none)."""
        return self._queue[0][1] if self._queue else math.inf

    def collect(self) -> tuple[Batch, BatchOutput]:
        batch, done, times, submitted, sent = self._queue.popleft()
        self.clock.now = max(self.clock.now, done)
        # the token is a function of the position only: outputs ignore EOS, so only lengths matter
        sampled, accepted = {}, {}
        for s in batch.seqs:
            if not s.sample:
                continue
            end = s.start_pos + len(s.token_ids) - s.num_draft_tokens
            if s.num_draft_tokens:
                a = 0
                while a < s.num_draft_tokens and self._spec_rng.random() < self.spec_acceptance:
                    a += 1
                accepted[s.req_id] = s.token_ids[len(s.token_ids) - s.num_draft_tokens:][:a]
                end += a
            sampled[s.req_id] = 1 + end % (self.vocab_size - 1)
        out = BatchOutput(batch.batch_id, sampled, {"forward_s": sum(times), "stages_s": times,
                                                     "submitted_s": submitted, "done_s": done},
                          accepted=accepted)
        if sent:
            out.kv_sent.update(sent)
            out.timings["kv_transfer_s"] = sum(v["kv_transfer_s"] for v in sent.values())
        return batch, out

    def abandon(self) -> None:
        self._queue.clear()


class Replica:
    """One scheduler + its simulated worker, on its own SimClock; kv_tier: a KVTier it shares
    with other replicas (its block manager a TieredBlockManager, loads over the worker's KV
    link: kv_bytes_per_token x tokens at kv_link_gbs GB/s, before the batch or, with
    tier_load_overlap, beside it: SimulatedWorker)."""

    def __init__(self, cost, sched_config: SchedulerConfig, *, block_size: int, num_blocks: int,
                 max_model_len: int, vocab_size: int = 32000, depth: int = 1, noise_sigma: float = 0.0,
                 seed: int = 0, spec_acceptance: float = 0.0, kv_bytes_per_token: int = 0,
                 kv_link_gbs: float = 25.0, kv_tier: KVTier | None = None, tier_load_overlap: bool = False):
        self.clock = SimClock()
        self.scheduler = Scheduler(sched_config, CacheConfig(block_size=block_size, num_blocks=num_blocks),
                                   ModelInfo("sim", max_model_len, vocab_size, [0], block_size=block_size,
                                             num_blocks=num_blocks), clock=self.clock)
        self.worker = SimulatedWorker(cost, self.clock, block_size, vocab_size, noise_sigma, seed,
                                      spec_acceptance=spec_acceptance,
                                      overlap_host=sched_config.async_scheduling,
                                      kv_bytes_per_token=kv_bytes_per_token, kv_link_gbs=kv_link_gbs)
        if kv_tier is not None:     # the same block manager, in front of the shared tier
            bm = self.scheduler.block_manager
            self.scheduler.block_manager = TieredBlockManager(
                kv_tier, bm.num_blocks, bm.block_size, bm.watermark_blocks, bm.cache is not None)
            self.worker.loads = self.scheduler.block_manager.take_loaded
            self.worker.load_overlap = tier_load_overlap
        if self.scheduler.speculator is not None:   # simulated tokens: acceptance is the parameter
            from scheduler_svc.speculative.synthetic import SyntheticProposer
            self.scheduler.speculator.proposer = SyntheticProposer()
        self.engine = EngineLoop(self.scheduler, self.worker, depth=depth)
        self.busy_s = 0.0   # virtual seconds this replica had unfinished requests (s)

    @property
    def unfinished(self) -> int:
        return len(self.scheduler.requests)


class KVTier:
    """A KV-cache tier every replica shares (host memory or a KV store beside the GPUs, as
    LMCache or Mooncake run one): every block a replica computes is written to it as well
    (write-through), and a replica loads from it the blocks after its own cached prefix instead
    of computing them (TieredBlockManager). Keys are the prefix-cache keys (a key names the
    whole prefix up to its block); least recently used first out past `capacity` blocks."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"a KV tier holds at least 1 block, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def put(self, key: int) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def has(self, key: int) -> bool:
        """Whether the tier holds the block (a hit counts as a use)."""
        if key in self._keys:
            self._keys.move_to_end(key)
            return True
        return False


class TieredBlockManager(BlockManager):
    """A replica's block manager in front of a KVTier, as vLLM's KV connector puts LMCache in
    front of its own: at allocation, the blocks after the locally cached prefix that the tier
    holds are loaded into the request's new blocks instead of computed (keyed and announced
    like blocks computed here; at least the prompt's last token is still computed); blocks
    computed here are written to the tier. `loaded` counts the blocks loaded, which the
    simulated worker takes (take_loaded) and charges before the batch that allocated them."""

    def __init__(self, tier: KVTier, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tier = tier
        self.loaded = 0          # blocks loaded from the tier, not yet charged
        self.loaded_total = 0    # blocks loaded from the tier since start

    def allocate(self, req, shared: list[int] | None = None) -> int:
        tokens = super().allocate(req, shared)
        if self.cache is None:
            return tokens
        first, num_full = req.num_cached_blocks, (req.num_tokens - 1) // self.block_size
        for key in req.block_hashes[:first]:    # local hits: still valid, kept warm in the tier
            self.tier.put(key)
        n = first
        while n < num_full and self.tier.has(req.block_hashes[n]):
            n += 1
        if n == first:
            return tokens
        stored = [j for j in range(first, n) if self.cache.insert(req.block_hashes[j], req.block_table[j])]
        if self.events is not None:
            self.events.stored(req, stored)
        req.num_cached_blocks = n
        req.num_computed_tokens = n * self.block_size
        self.loaded += n - first
        self.loaded_total += n - first
        return req.num_computed_tokens

    def cache_computed_blocks(self, req, upto: int | None = None) -> None:
        before = req.num_cached_blocks
        super().cache_computed_blocks(req, upto)
        for key in req.block_hashes[before:req.num_cached_blocks]:
            self.tier.put(key)

    def take_loaded(self) -> int:
        n, self.loaded = self.loaded, 0
        return n


def run_replicas(replicas: list[Replica], workload: list[RequestSpec], *, drain_s: float,
                 on_progress: Callable[[int], None] | None = None, windows: int = 0,
                 routing: str = "least-unfinished", max_waiting: int = 64,
                 seed: int = 0, routes: dict[str, int] | None = None) -> tuple[RunResult, dict]:
    """Drive the replicas through the workload on virtual time (see the module doc). Returns the
    run (records of every request, iterations of every replica in start order) and extras:
    per-replica request counts, the prefix-cache hit rate (tokens found cached / tokens looked up
    at admission, all replicas, from the first request arriving at or after 0), the pipeline
    bubble fraction. Requests arriving before 0 warm the replicas up: they run, and are left out
    of the records, iterations and hit rate. routing: one of
    sarathi.measure.routing.ROUTINGS; max_waiting: the scheduler service's local queue bound
    (shared-queue pulls); seed: the picker's tie-breaks; routes: if given, filled with request id
    -> the index of the replica that served it. Replicas in front of a KV tier: blocks loaded
    from it count as prefix hits; extras `kv_tier_*` count them (warm-up included)."""
    from sarathi.measure.routing import OWN_RULE, ROUTINGS, WEIGHTS, Picker

    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; choose one of {', '.join(ROUTINGS)}")
    picker = Picker(routing, replicas, replicas[0].scheduler.block_manager.block_size, seed) \
        if routing in WEIGHTS or routing in OWN_RULE else None
    end = max((s.arrival for s in workload), default=0.0) + drain_s
    # warm-up requests (arrivals before 0): the run starts at the first of them (virtual clocks
    # start at 0: every time is shifted by `offset`, and shifted back in the results)
    offset = max(0.0, -min((s.arrival for s in workload), default=0.0))
    if offset:
        workload = [dataclasses.replace(spec, arrival=spec.arrival + offset) for spec in workload]
        end += offset
    follow = FollowUps(workload)    # follow-ups wait for the answer before them (ChatShape)
    pending = deque(sorted((s for s in workload if not follow.held(s)), key=lambda s: s.arrival))

    def prefix_tokens() -> tuple[int, int]:   # (hit, looked-up) tokens over the replicas so far
        st = [r.scheduler.stats() for r in replicas]
        return (sum(x["prefix_cache_hit_tokens"] for x in st), sum(x["prefix_cache_query_tokens"] for x in st))
    warm_prefix = None if offset else (0, 0)
    shared: deque[RequestSpec] = deque()     # routing shared-queue: arrived, not pulled yet
    held: deque[RequestSpec] = deque()       # a flow-controlled picker's queue: arrived, not sent yet
    flow = picker is not None and picker.flow_control
    reqs, iterations = {}, []
    last_batch: list[Batch] = []
    for r in replicas:
        r.engine.on_batch = lambda batch, output, seconds: last_batch.append(batch)
    routed = [0] * len(replicas)

    def admit(i: int, spec: RequestSpec, at: float | None = None) -> None:
        """spec goes to replica i at `at` (default: its arrival), never earlier than a busy
        replica's clock (callers pass the earliest event time)."""
        nonlocal warm_prefix
        if warm_prefix is None and spec.arrival >= offset:
            warm_prefix = prefix_tokens()      # the measured part starts: count its lookups only
        r = replicas[i]
        routed[i] += 1
        if routes is not None:
            routes[spec.req_id] = i
        r.clock.now = max(r.clock.now, spec.arrival if at is None else at)   # an idle replica wakes then
        reqs[spec.req_id] = (spec, r.engine.add_request(
            spec.req_id, spec.prompt_ids, bench_sampling(spec.max_tokens), spec.arrival))

    def release(at: float) -> None:
        """Flow control: the picker's queue sends its head while the pool is not saturated, at
        `at`, the current event time (no busy replica's clock is earlier)."""
        while held and not picker.saturated():
            spec = held.popleft()
            admit(picker.pick(spec.prompt_ids, spec.req_id), spec, at)

    def idle() -> list[int]:   # replicas blocked on the shared queue, longest idle first
        return sorted((k for k, r in enumerate(replicas) if not r.scheduler.has_unfinished()),
                      key=lambda k: (replicas[k].clock.now, k))

    while True:
        while shared and (free := idle()):     # a blocked replica takes a queued request at once
            admit(free[0], shared.popleft())
        busy = [r for r in replicas if r.scheduler.has_unfinished()]
        if held and not busy:        # the last busy replica just finished: the pool is free
            release(max(r.clock.now for r in replicas))
            busy = [r for r in replicas if r.scheduler.has_unfinished()]
        t_busy = min((r.clock.now for r in busy), default=float("inf"))
        t_arr = pending[0].arrival if pending else float("inf")
        if min(t_busy, t_arr) >= end:
            break
        if t_arr <= t_busy:
            spec = pending.popleft()
            if routing == "shared-queue":
                shared.append(spec)
                continue
            if flow:                 # into the picker's queue, its head sent while the pool has room
                held.append(spec)
                release(spec.arrival)
                continue
            i = (picker.pick(spec.prompt_ids, spec.req_id) if picker is not None
                 else min(range(len(replicas)), key=lambda k: (replicas[k].unfinished, k)))
            admit(i, spec)
            continue
        r = min(busy, key=lambda x: x.clock.now)
        if held:     # its iteration boundary, the earliest: what finished may have freed the pool
            release(r.clock.now)
        if shared:   # its iteration boundary: pull what fits (the service's pull rule)
            s = r.scheduler
            room = min(max_waiting - len(s.waiting), s.config.max_num_seqs - len(s.running) - len(s.waiting))
            for _ in range(max(0, min(room, len(shared)))):
                admit(replicas.index(r), shared.popleft())
        started = r.clock.now
        last_batch.clear()
        events = r.engine.step()     # raises StalledError when nothing can ever run
        r.busy_s += r.clock.now - started
        done = follow.released(events, r.clock.now, pending)
        if done and on_progress:
            on_progress(done)
        if last_batch:
            batch = last_batch[0]
            tokens, kv, pairs, seqs = aggregates(batch_shapes(batch))
            decodes = sum(1 for s in batch.seqs if s.is_decode)
            iterations.append(IterationRecord(started, r.clock.now - started, tokens - decodes,
                                              decodes, seqs, kv, pairs))
    records = [_record(spec, 0.0, list(req.token_times), req.first_scheduled_time,
                       req.finish_reason in ("stop", "length"), req.error)
               for spec, req in reqs.values() if spec.arrival >= offset]
    records += [_record(spec, 0.0, [], None, False, None) for spec in pending]
    busy_s = sum(sum(r.worker.busy) for r in replicas)
    bubble_s = sum(sum(r.worker.bubble) for r in replicas)
    stage_time = sum(len(r.worker.busy) * r.busy_s for r in replicas)
    records += [_record(spec, 0.0, [], None, False, None) for q in (shared, held) for spec in q
                if spec.arrival >= offset]
    if offset:   # back to the workload's times; the warm-up's iterations left out
        for rec in records:
            rec.arrival -= offset
            rec.token_times = [t - offset for t in rec.token_times]
            if rec.first_scheduled is not None:
                rec.first_scheduled -= offset
        iterations = [dataclasses.replace(it, start=it.start - offset) for it in iterations if it.start >= offset]
    hit, looked = (a - b for a, b in zip(prefix_tokens(), warm_prefix or (0, 0)))
    extra = {"replica_requests": routed, "routing": routing,
             "warmup_requests": sum(1 for spec, _ in reqs.values() if spec.arrival < offset),
             "prefix_hit_rate": hit / looked if looked else 0.0,
             "pp_bubble_fraction": bubble_s / (busy_s + bubble_s) if busy_s + bubble_s else 0.0,
             "pp_idle_fraction": max(0.0, 1 - busy_s / stage_time) if stage_time else 0.0,
             "stage_busy_s": [[round(b, 4) for b in r.worker.busy] for r in replicas]}
    tiered = [r for r in replicas if isinstance(r.scheduler.block_manager, TieredBlockManager)]
    if tiered:
        extra["kv_tier_loaded_blocks"] = sum(r.scheduler.block_manager.loaded_total for r in tiered)
        extra["kv_tier_load_s"] = round(sum(r.worker.tier_load_s for r in tiered), 4)
    iterations.sort(key=lambda it: it.start)
    end_time = max(r.clock.now for r in replicas) - offset
    if windows:
        extra["windows"] = windowed_tbt_p99(records, 0.0, end_time, windows)
    adaptive = getattr(replicas[0].scheduler.policy, "adaptive", None)
    if adaptive is not None:   # tau over time (replica 0), at most ~1000 points
        h = adaptive.history
        extra["tau_history"] = [[round(t, 3), tau] for t, tau in h[::max(1, len(h) // 1000)]]
    return RunResult(records, iterations, end_time), extra


def simulated_target(cost, *, replicas: int = 1, depth: int = 1, block_size: int = 16,
                     num_blocks: int = 2048, max_model_len: int = 8192, vocab_size: int = 32000,
                     sched_config: SchedulerConfig | None = None, description: dict | None = None,
                     windows: int = 0, noise_sigma: float = 0.0, spec_acceptance: float = 0.0,
                     routing: str = "least-unfinished", kv_tier_blocks: int = 0, tier_load_overlap: bool = False,
                     kv_bytes_per_token: int = 0, kv_link_gbs: float = 25.0) -> Target:
    """A Target whose runs go to `replicas` simulated replicas (each `depth` micro-batches in
    flight: the PP degree) with the given cost model; sched_config is the template each run
    copies with its policy and tau. windows > 0: each run's summary has P99 TBT per time window.
    noise_sigma: lognormal iteration-time variation (SimulatedWorker). spec_acceptance: the
    draft acceptance probability when sched_config speculates (SimulatedWorker). routing: how
    arrivals reach the replicas (sarathi.measure.routing.ROUTINGS). kv_tier_blocks > 0: a KVTier
    of that many blocks shared by the replicas (a new one each run), a copy from it taking
    kv_bytes_per_token x its tokens over a kv_link_gbs GB/s link (before the batch that needs
    them, or beside it with tier_load_overlap)."""
    import dataclasses

    base = sched_config or SchedulerConfig()

    def run(policy: str, tau: int, workload: list[RequestSpec], drain_s: float, on_progress) -> tuple:
        cfg = dataclasses.replace(base, policy=policy, token_budget=tau, max_model_len=max_model_len)
        tier = KVTier(kv_tier_blocks) if kv_tier_blocks > 0 else None
        reps = [Replica(cost, cfg, block_size=block_size, num_blocks=num_blocks,
                        max_model_len=max_model_len, vocab_size=vocab_size, depth=depth,
                        noise_sigma=noise_sigma, seed=i, spec_acceptance=spec_acceptance,
                        kv_bytes_per_token=kv_bytes_per_token, kv_link_gbs=kv_link_gbs, kv_tier=tier,
                        tier_load_overlap=tier_load_overlap)
                for i in range(replicas)]
        return run_replicas(reps, workload, drain_s=drain_s, on_progress=on_progress, windows=windows,
                            routing=routing)

    return Target("sim", run=run, max_model_len=max_model_len, vocab_size=vocab_size,
                  description=description or {})


# -- worker pools: colocated replicas and prefill/decode disaggregation --------------------------
ROLE_LAYOUTS = ("replicas", "pd")


def make_sim_poolset(cost, sched_config: SchedulerConfig, roles: list[str], *, mode: str = "off",
                     threshold_tokens: int = 256, backlog_margin_tokens: int = 2048,
                     prefill_token_budget: int = 0, block_size: int = 16, num_blocks: int = 2048,
                     max_model_len: int = 8192, vocab_size: int = 32000, depth: int = 1,
                     kv_bytes_per_token: int = 0, kv_link_gbs: float = 25.0,
                     noise_sigma: float = 0.0, seed: int = 0):
    """The real PoolSet + Router over one SimulatedWorker per role (e.g. ["mixed", "mixed"] or
    ["prefill", "decode"]), all on one SimClock. A prefill pool's token budget is
    prefill_token_budget (0: the config's); KV sends cost bytes / kv_link_gbs (SimulatedWorker)."""
    import dataclasses

    from scheduler_svc.pools import Pool, PoolSet
    from scheduler_svc.router import Router, RouterConfig

    clock, pools = SimClock(), []
    for i, role in enumerate(roles):
        cfg = dataclasses.replace(sched_config, max_model_len=max_model_len)
        if role == "prefill" and prefill_token_budget:
            cfg = dataclasses.replace(cfg, token_budget=prefill_token_budget,
                                      max_num_batched_tokens=max(cfg.max_num_batched_tokens,
                                                                 prefill_token_budget))
        sched = Scheduler(cfg, CacheConfig(block_size=block_size, num_blocks=num_blocks),
                          ModelInfo("sim", max_model_len, vocab_size, [0], block_size=block_size,
                                    num_blocks=num_blocks), clock=clock)
        worker = SimulatedWorker(cost, clock, block_size, vocab_size, noise_sigma, seed + i,
                                 kv_bytes_per_token=kv_bytes_per_token, kv_link_gbs=kv_link_gbs)
        pools.append(Pool(f"{role}{i}", role, sched, worker, kv_address=f"sim://{role}{i}", depth=depth))
    router = Router(RouterConfig(mode, threshold_tokens, backlog_margin_tokens))
    return PoolSet(pools, router), clock


def run_pools(ps, clock: SimClock, workload: list[RequestSpec], *, drain_s: float,
              on_progress: Callable[[int], None] | None = None) -> tuple[RunResult, dict]:
    """Drive a PoolSet of SimulatedWorkers through the workload on virtual time: admit the
    arrivals due, step the PoolSet (it fills every pool and collects every batch that has ended)
    until nothing changes at this instant, then move the clock to the next batch end or arrival.
    Token times are the clock at the step that published them (the scheduler's own times).

    Returns the run and extras: per pool its role, requests routed and busy seconds; per
    disaggregated request its KV transfer (bytes, seconds, queue, prefill); the transfer's share
    of the median TTFT of disaggregated requests; the counters of the coordinator."""
    end = (workload[-1].arrival if workload else 0.0) + drain_s
    pending = deque(sorted(workload, key=lambda s: s.arrival))
    specs: dict[str, RequestSpec] = {}
    first_sched: dict[str, object] = {}
    times: dict[str, list[float]] = {}
    ended: dict[str, tuple[str, str | None]] = {}
    routed = {p.name: 0 for p in ps.pools}
    iterations: list[IterationRecord] = []
    collected = [0]

    def on_batch(pool, batch: Batch, output: BatchOutput, seconds: float) -> None:
        collected[0] += 1
        tokens, kv, pairs, seqs = aggregates(batch_shapes(batch))
        decodes = sum(1 for s in batch.seqs if s.is_decode)
        start = output.timings["submitted_s"]
        iterations.append(IterationRecord(start, output.timings["done_s"] - start, tokens - decodes,
                                          decodes, seqs, kv, pairs))

    ps.on_batch = on_batch
    while True:
        while pending and pending[0].arrival <= clock.now:
            spec = pending.popleft()
            req = ps.add_request(spec.req_id, spec.prompt_ids, bench_sampling(spec.max_tokens), spec.arrival)
            specs[spec.req_id], first_sched[spec.req_id], times[spec.req_id] = spec, req, []
            owner = ps.owner(spec.req_id)
            if owner is not None:
                routed[owner.name] += 1
        if clock.now >= end:
            break
        before = (collected[0], sum(len(p.loop.in_flight) for p in ps.pools))
        done = 0
        for ev in ps.step(wait_s=0.0):
            t = times.get(ev.req_id)
            if t is not None and ev.token_id is not None and ev.index == len(t):
                t.append(clock.now)
            if ev.finish_reason is not None and ev.req_id not in ended:
                ended[ev.req_id] = (ev.finish_reason, ev.error)
                done += 1
        if done and on_progress:
            on_progress(done)
        if (collected[0], sum(len(p.loop.in_flight) for p in ps.pools)) != before:
            continue   # something ran or was submitted: let the pools refill at this instant
        t_next = min([p.executor.next_done for p in ps.pools if p.loop.in_flight]
                     + [pending[0].arrival if pending else math.inf])
        if t_next == math.inf:
            if ps.has_unfinished():
                from scheduler_svc.engine_loop import StalledError
                raise StalledError(f"nothing schedulable; stats: {ps.stats()}")
            break
        clock.now = max(clock.now, min(t_next, end))
    records = []
    for rid, spec in specs.items():
        reason, error = ended.get(rid, (None, None))
        fs = first_sched[rid].first_scheduled_time
        records.append(_record(spec, 0.0, times[rid], fs, reason in ("stop", "length"), error))
    records += [_record(spec, 0.0, [], None, False, None) for spec in pending]
    transfers = ps.transfer_dicts()
    ttft = {r.req_id: r.ttft for r in records}
    for t in transfers:
        t["ttft_s"] = ttft.get(t["req_id"], math.inf)
    extra = {"pools": [{"name": p.name, "role": p.role, "requests_routed": routed[p.name],
                        "busy_s": round(sum(p.executor.busy), 4), "kv_send_s": round(p.executor.kv_s, 7)}
                       for p in ps.pools],
             "counters": dict(ps.counters), **transfer_summary(transfers)}
    iterations.sort(key=lambda it: it.start)
    return RunResult(records, iterations, clock.now), {**extra, "transfers": transfers}


def transfer_summary(transfers: list[dict]) -> dict:
    """Over disaggregated requests: how many, median KV bytes and transfer seconds, median TTFT,
    and the transfer's share of it (median transfer / median TTFT; and the median per-request
    share)."""
    from sarathi.measure.metrics import percentile

    if not transfers:
        return {"disaggregated_requests": 0}
    secs = [t["kv_transfer_s"] for t in transfers]
    ttft = [t["ttft_s"] for t in transfers]
    med_ttft = percentile(ttft, 50)
    return {"disaggregated_requests": len(transfers),
            "kv_bytes_p50": percentile([t["kv_bytes"] for t in transfers], 50),
            "kv_transfer_p50_s": percentile(secs, 50),
            "kv_transfer_total_s": sum(secs),
            "disagg_ttft_p50_s": med_ttft,
            "kv_transfer_share_of_ttft_p50": (percentile(secs, 50) / med_ttft
                                              if math.isfinite(med_ttft) and med_ttft > 0 else math.nan),
            "kv_transfer_share_p50": percentile([s / t if t > 0 else math.nan for s, t in zip(secs, ttft)
                                                 if math.isfinite(t)], 50)}


def pool_target(cost, *, roles: list[str], mode: str = "off", threshold_tokens: int = 256,
                backlog_margin_tokens: int = 2048, prefill_token_budget: int = 0, depth: int = 1,
                block_size: int = 16, num_blocks: int = 2048, max_model_len: int = 8192,
                vocab_size: int = 32000, kv_bytes_per_token: int = 0, kv_link_gbs: float = 25.0,
                sched_config: SchedulerConfig | None = None, description: dict | None = None,
                noise_sigma: float = 0.0, keep_transfers: bool = True) -> Target:
    """A Target whose runs go to a simulated PoolSet (make_sim_poolset): `roles` one pool each,
    the Router in `mode`. keep_transfers=False leaves the per-request transfer list out of the
    summary (its aggregate stays)."""
    import dataclasses

    base = sched_config or SchedulerConfig()

    def run(policy: str, tau: int, workload: list[RequestSpec], drain_s: float, on_progress) -> tuple:
        cfg = dataclasses.replace(base, policy=policy, token_budget=tau)
        ps, clock = make_sim_poolset(
            cost, cfg, roles, mode=mode, threshold_tokens=threshold_tokens,
            backlog_margin_tokens=backlog_margin_tokens, prefill_token_budget=prefill_token_budget,
            block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len,
            vocab_size=vocab_size, depth=depth, kv_bytes_per_token=kv_bytes_per_token,
            kv_link_gbs=kv_link_gbs, noise_sigma=noise_sigma)
        rr, extra = run_pools(ps, clock, workload, drain_s=drain_s, on_progress=on_progress)
        if not keep_transfers:
            extra.pop("transfers")
        return rr, extra

    return Target("sim", run=run, max_model_len=max_model_len, vocab_size=vocab_size,
                  description=description or {})

"""Routing requests across replicas in `sarathi simulate --replicas N --routing R`.

Two ways a request reaches a replica:

* ``shared-queue``: today's distributed mode. Requests wait in one queue (the Redis consumer
  group); a replica blocked on the queue while idle takes a request the moment it arrives, a busy
  one takes what is queued at its next iteration boundary, up to its room (the scheduler
  service's pull rule: min(max_waiting - waiting, max_num_seqs - running - waiting)). Whoever
  pulls first wins: blind to load beyond that room and to the prefix cache.
* a picker (Kubernetes' inference gateway's endpoint picker): every request is scored on every
  replica at its arrival and sent to the highest total score (ties broken at random, seeded),
  where it waits in the replica's own queue. The scorers, as the picker's:

  - ``queue``: (max q - q) / (max q - min q) over the replicas, q = requests waiting on the
    replica (vllm:num_requests_waiting); 1 for all when all are equal;
  - ``kv``: 1 - KV-cache usage (vllm:kv_cache_usage_perc);
  - ``prefix``: the fraction of the prompt's full blocks found, as a leading run, in the replica's
    cache, as a precise prefix-cache scorer sees it: an index fed by each replica's KV-cache events
    (scheduler_svc.kv_events, the same recorder the scheduler publishes from) and the prompt's
    block hashes computed the way the events' consumer does.

  Routings: ``least-queue`` = queue + kv (weights 1, 1: the picker's load scorers); ``prefix`` =
  prefix alone; ``mix`` = prefix 3 + queue 1 + kv 1 (the picker's default profile's weights);
  ``mix-lowq`` = mix behind the picker's low-queue filter (a decision tree: the replicas with at
  most LOW_QUEUE_THRESHOLD requests waiting, or, when none is that short, the least queued ones;
  the scorers then rank the survivors, the queue score normalized over them as the picker does);
  ``mix-fc`` = mix behind the picker's flow control (its FlowController with the utilization
  saturation detector): a request that arrives while the pool is saturated waits in the picker's
  own queue (first come, first served) instead of a replica's, and the queue's head is sent as
  soon as the pool is not; a replica is saturated at max(waiting / SATURATION_QUEUE, KV usage /
  SATURATION_KV) >= 1, the pool at the mean of that over the replicas >= 1 (the detector's
  roofline score), and the detector's filter keeps a saturated replica out of the candidates
  while any other is not (headroom 0). The thresholds are the detector's defaults.

* ``kv-cost``: NVIDIA Dynamo's KV router, another published cache-aware router: no scores
  normalized over the replicas but one cost in KV blocks per replica, the lowest taken (ties at
  random, seeded):

      cost = KV_COST_OVERLAP_WEIGHT * prefill blocks + decode blocks

  prefill blocks: the replica's pending prefill (the uncached prompt tokens of the requests the
  router sent it that have not produced their first token) plus this prompt's uncached tokens
  there (its length less the leading blocks the replica holds, from the KV events), over the
  block size; decode blocks: KV blocks the replica's active requests hold, plus this prompt's.
  The router keeps the pending prefill itself (what it sent, released at the first token), as
  Dynamo's does; a cache hit thus counts in tokens of work saved, against the queued work it
  would wait behind, where the picker's prefix score is a fraction of the prompt.
* ``cache-aware``: SGLang's router (its `cache_aware` policy, the default of SGLang's model
  gateway), a decision rule rather than a sum: when the replicas' loads (unfinished requests the
  router sent) are imbalanced, max - min > CACHE_AWARE_BALANCE_ABS and max > min x
  CACHE_AWARE_BALANCE_REL, the least loaded; else, when some replica holds more than
  CACHE_AWARE_THRESHOLD of the prompt's blocks, the one that holds the most (ties: the least
  loaded); else the replica whose cache holds the fewest blocks (the most room). Its defaults.

The scorers are one class (Scorer) over whatever state it is handed: Picker hands it the
simulated replicas' schedulers, bench/picker_router.py (a live picker in front of real replicas)
the metrics it scraped and the KV events it subscribed to.

The picker here reads the replicas' state at the arrival instant; the real one reads metrics it
scraped up to a refresh interval earlier and events a few milliseconds old, so this is its best
case for load, and exact for the prefix cache.
"""
from __future__ import annotations

import numpy as np

from scheduler_svc.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecorder, block_hash, root_hash
from shared.config import cdiv

ROUTINGS = ("least-unfinished", "shared-queue", "least-queue", "prefix", "mix", "mix-lowq", "mix-fc", "kv-cost",
            "cache-aware")
WEIGHTS = {"least-queue": {"queue": 1.0, "kv": 1.0}, "prefix": {"prefix": 1.0},
           "mix": {"prefix": 3.0, "queue": 1.0, "kv": 1.0}}
WEIGHTS["mix-lowq"] = WEIGHTS["mix"]    # the same scorers, behind the filter
WEIGHTS["mix-fc"] = WEIGHTS["mix"]      # the same scorers, behind flow control
# requests waiting at most, for a replica to pass mix-lowq's filter (the picker's low-queue filter
# `threshold`; its default, 128, never filters at the loads simulated here)
LOW_QUEUE_THRESHOLD = 4
FILTERED = {"mix-lowq"}
# flow control's saturation detector (the utilization detector's defaults: queueDepthThreshold 5,
# kvCacheUtilThreshold 0.8, headroom 0)
SATURATION_QUEUE = 5
SATURATION_KV = 0.8
FLOW_CONTROLLED = {"mix-fc"}
SATURATION_FILTER = True   # the detector's filter in the scheduling profile too (else the gate alone)
# kv-cost: the weight of prefill blocks against decode blocks (Dynamo's kv-overlap-score-weight,
# default 1.0: a block of prompt to compute costs as much as a block of KV held)
KV_COST_OVERLAP_WEIGHT = 1.0
# cache-aware: SGLang's router defaults (--balance-abs-threshold 64, --balance-rel-threshold 1.5,
# --cache-threshold 0.3)
CACHE_AWARE_BALANCE_ABS = 64
CACHE_AWARE_BALANCE_REL = 1.5
CACHE_AWARE_THRESHOLD = 0.3
OWN_RULE = {"kv-cost", "cache-aware"}   # routings of their own rule, not the picker's weighted sum


class PrefixIndex:
    """Which block hashes each replica holds, from its KV-cache events (what an external
    indexer builds from the replicas' event streams)."""

    def __init__(self, num_replicas: int):
        self.blocks: list[set[int]] = [set() for _ in range(num_replicas)]

    def sink(self, replica: int):
        """The event callback of one replica's recorder."""
        held = self.blocks[replica]

        def apply(ev) -> None:
            if isinstance(ev, BlockStored):
                held.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                held.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                held.clear()
        return apply

    def matched(self, replica: int, hashes: list[int]) -> int:
        """Leading blocks of `hashes` the replica holds."""
        held, n = self.blocks[replica], 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n


class Scorer:
    """The endpoint picker's weighted scorers over N replicas' state, wherever that state comes
    from: the simulated replicas' schedulers (Picker) or a live router's scrapes of real
    replicas' metrics and subscription to their KV-cache events (bench/picker_router.py).

    choose(prompt_ids, waiting, kv_usage): waiting[i] = requests queued on replica i
    (vllm:num_requests_waiting), kv_usage[i] = its KV-cache usage, 0 to 1
    (vllm:kv_cache_usage_perc); the prefix scorer reads `index` (a PrefixIndex the caller feeds
    from the replicas' events). Block hashes are the events' chain (hash_seed: the replicas'),
    so a lookup and an announced block agree."""

    MEMO_MAX = 1 << 20   # remembered block hashes; a long-lived router starts over past this

    def __init__(self, routing: str, num_replicas: int, block_size: int, seed: int = 0, hash_seed: str = "0", *,
                 overlap_weight: float | None = None, balance_abs: float | None = None,
                 balance_rel: float | None = None, cache_threshold: float | None = None):
        """overlap_weight (kv-cost), balance_abs, balance_rel, cache_threshold (cache-aware):
        this router's settings; None: the module's defaults (KV_COST_OVERLAP_WEIGHT,
        CACHE_AWARE_*), read at each pick."""
        if routing not in WEIGHTS and routing not in OWN_RULE:
            raise ValueError(f"no picker for routing {routing!r}")
        self.routing = routing
        self.overlap_weight, self.cache_threshold = overlap_weight, cache_threshold
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.own_rule = routing in OWN_RULE
        self.weights = WEIGHTS.get(routing, {})
        self.low_queue = LOW_QUEUE_THRESHOLD if routing in FILTERED else None
        self.flow_control = routing in FLOW_CONTROLLED
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.rng = np.random.default_rng(seed)
        self.index = PrefixIndex(num_replicas) if self.own_rule or "prefix" in self.weights else None
        self._root = root_hash(hash_seed)
        self._memo: dict[tuple, int] = {}   # (parent hash, block tokens) -> hash
        self.matched_blocks = 0     # over all picks: blocks the chosen replica held (prefix scorer)
        self.last_match = 0         # the last pick's: leading blocks of its prompt the chosen replica held
        self.prompt_blocks = 0

    def _hashes(self, prompt_ids: list[int]) -> list[int]:
        """scheduler_svc.kv_events.prefix_hashes(prompt_ids), each block's hash remembered by
        (hash of the block before, its tokens): a follow-up turn rehashes only its new blocks."""
        bs, out = self.block_size, []
        parent = self._root
        memo = self._memo
        if len(memo) > self.MEMO_MAX:
            memo.clear()
        for i in range(len(prompt_ids) // bs):
            key = (parent, tuple(prompt_ids[i * bs:(i + 1) * bs]))
            h = memo.get(key)
            if h is None:
                h = memo[key] = block_hash(parent, key[1])
            out.append(h)
            parent = h
        return out

    def state(self) -> tuple[list, list]:
        """(waiting, kv_usage) of every replica now, when the caller does not pass them."""
        raise NotImplementedError

    @staticmethod
    def replica_saturation(waiting, kv_usage) -> np.ndarray:
        """Each replica's saturation score, the detector's roofline: max(waiting /
        SATURATION_QUEUE, KV usage / SATURATION_KV); 1 or more is saturated."""
        return np.maximum(np.asarray(waiting, dtype=float) / SATURATION_QUEUE,
                          np.asarray(kv_usage, dtype=float) / SATURATION_KV)

    def saturated(self, waiting=None, kv_usage=None) -> bool:
        """Whether flow control holds requests now: the mean replica saturation is 1 or more
        (no replica at all counts as saturated)."""
        if waiting is None or kv_usage is None:
            waiting, kv_usage = self.state()
        sat = self.replica_saturation(waiting, kv_usage)
        return len(sat) == 0 or float(sat.mean()) >= 1.0

    def scores(self, prompt_ids: list[int], waiting=None, kv_usage=None) -> tuple[np.ndarray, list[int] | None]:
        """Each replica's total score, and the leading blocks of the prompt each holds (None
        without the prefix scorer); the load state from state() unless given."""
        if waiting is None or kv_usage is None:
            waiting, kv_usage = self.state()
        n = self.num_replicas
        q_all = np.asarray(waiting, dtype=float)
        keep = np.ones(n, dtype=bool)
        if self.low_queue is not None:   # the low-queue filter; none passes: the least queued
            keep = q_all <= self.low_queue
            if not keep.any():
                keep = q_all <= q_all.min()
        if self.flow_control and SATURATION_FILTER:   # the saturation filter; none passes: all
            keep = self.replica_saturation(q_all, kv_usage) < 1.0
            if not keep.any():
                keep = np.ones(n, dtype=bool)
        total = np.where(keep, 0.0, -np.inf)
        w = self.weights
        if "queue" in w:
            q = q_all[keep]
            span = q.max() - q.min()
            total[keep] += w["queue"] * ((q.max() - q) / span if span > 0 else np.ones(len(q)))
        if "kv" in w:
            total += w["kv"] * (1.0 - np.asarray(kv_usage, dtype=float))
        matched = None
        if "prefix" in w:
            hashes, matched = self._lookup(prompt_ids)
            if hashes:
                total += w["prefix"] * np.array(matched, dtype=float) / len(hashes)
        return total, matched

    def _lookup(self, prompt_ids: list[int]) -> tuple[list[int], list[int]]:
        """The prompt's block hashes, and the leading blocks of them each replica holds (counted
        in prompt_blocks)."""
        hashes = self._hashes(prompt_ids)
        self.prompt_blocks += len(hashes)
        return hashes, [self.index.matched(i, hashes) for i in range(self.num_replicas)]

    def costs(self, prompt_ids: list[int], pending_prefill, active_blocks) -> tuple[np.ndarray, list[int]]:
        """kv-cost: each replica's cost in blocks, and the leading blocks of the prompt each
        holds. pending_prefill[i]: uncached prompt tokens sent to replica i and not yet past
        their first token; active_blocks[i]: KV blocks its active requests hold."""
        _, matched = self._lookup(prompt_ids)
        bs = self.block_size
        new = np.maximum(0, len(prompt_ids) - np.array(matched, dtype=float) * bs)
        prefill = (np.asarray(pending_prefill, dtype=float) + new) / bs
        decode = np.asarray(active_blocks, dtype=float) + cdiv(len(prompt_ids), bs)
        w = KV_COST_OVERLAP_WEIGHT if self.overlap_weight is None else self.overlap_weight
        return w * prefill + decode, matched

    def cache_aware(self, prompt_ids: list[int], loads) -> tuple[np.ndarray, list[int]]:
        """cache-aware: the candidates SGLang's rule leaves (a boolean mask), and the leading
        blocks of the prompt each replica holds. loads[i]: unfinished requests sent to replica i."""
        hashes, matched = self._lookup(prompt_ids)
        load = np.asarray(loads, dtype=float)
        m = np.array(matched, dtype=float)
        b_abs = CACHE_AWARE_BALANCE_ABS if self.balance_abs is None else self.balance_abs
        b_rel = CACHE_AWARE_BALANCE_REL if self.balance_rel is None else self.balance_rel
        threshold = CACHE_AWARE_THRESHOLD if self.cache_threshold is None else self.cache_threshold
        if load.max() - load.min() > b_abs and load.max() > b_rel * load.min():
            return load == load.min(), matched
        if hashes and m.max() / len(hashes) > threshold:
            best = m == m.max()
            return best & (load == load[best].min()), matched
        size = np.array([len(b) for b in self.index.blocks], dtype=float)
        return size == size.min(), matched

    def choose(self, prompt_ids: list[int], waiting=None, kv_usage=None, *, pending_prefill=None,
               active_blocks=None) -> int:
        """The replica with the highest total score (kv-cost: the lowest cost, from
        pending_prefill and active_blocks; cache-aware: SGLang's rule, `waiting` the replicas'
        loads; ties broken at random, seeded)."""
        if self.routing == "cache-aware":
            keep, matched = self.cache_aware(prompt_ids, waiting)
            total = np.where(keep, 0.0, -np.inf)
        elif self.own_rule:
            cost, matched = self.costs(prompt_ids, pending_prefill, active_blocks)
            total = -cost
        else:
            total, matched = self.scores(prompt_ids, waiting, kv_usage)
        best = np.flatnonzero(total >= total.max() - 1e-12)
        i = int(best[self.rng.integers(len(best))]) if len(best) > 1 else int(best[0])
        self.last_match = 0 if matched is None else matched[i]
        self.matched_blocks += self.last_match
        return i

    def new_prefill_tokens(self, prompt_ids: list[int]) -> int:
        """Of the prompt the last choose() placed: the tokens its replica will compute (the
        leading blocks that replica holds off)."""
        return max(0, len(prompt_ids) - self.last_match * self.block_size)


class Picker(Scorer):
    """The scorers over simulated replicas (sarathi.measure.simulate Replica objects:
    .scheduler), read at the arrival instant; each replica's block manager records its KV-cache
    events straight into the index."""

    def __init__(self, routing: str, replicas: list, block_size: int, seed: int = 0):
        super().__init__(routing, len(replicas), block_size, seed)
        self.replicas = replicas
        if self.index is not None:
            for i, r in enumerate(replicas):
                bm = r.scheduler.block_manager
                if bm.cache is None:
                    raise ValueError("prefix-aware routing needs prefix caching (--prefix-caching)")
                bm.events = KVEventRecorder(block_size, sink=self.index.sink(i))
        self.sent: list[dict[str, int]] = [{} for _ in replicas]   # kv-cost: req id -> prefill tokens

    def state(self) -> tuple[list, list]:
        return ([len(r.scheduler.waiting) for r in self.replicas],
                [r.scheduler.block_manager.num_used_blocks / r.scheduler.block_manager.num_blocks
                 for r in self.replicas])

    def pick(self, prompt_ids: list[int], req_id: str | None = None) -> int:
        """The replica for a request arriving now; req_id: kv-cost's record of what it sent
        (released when the request has its first token or is gone)."""
        if not self.own_rule:
            return self.choose(prompt_ids)
        if self.routing == "cache-aware":   # load: unfinished requests (the router's own count)
            return self.choose(prompt_ids, [len(r.scheduler.requests) for r in self.replicas])
        pending = []
        for i, r in enumerate(self.replicas):   # what the router sent that is still in prefill
            sent, reqs = self.sent[i], r.scheduler.requests
            for rid in [rid for rid in sent if rid not in reqs or reqs[rid].num_output_tokens]:
                del sent[rid]
            pending.append(sum(sent.values()))
        i = self.choose(prompt_ids, pending_prefill=pending,
                        active_blocks=[r.scheduler.block_manager.num_used_blocks for r in self.replicas])
        if req_id is not None:
            self.sent[i][req_id] = self.new_prefill_tokens(prompt_ids)
        return i

"""Several worker pools under one scheduler: colocated replicas and prefill/decode disaggregation.

One scheduler service owns every request and every worker's block tables. A `Pool` is one
worker (or TP x PP replica): its executor, its own Scheduler (its BlockManager = that worker's
KV blocks, its own policy instance), its EngineLoop, its role (mixed | prefill | decode, see
scheduler_svc.router) and whether it is up. `PoolSet` drives them all from ONE thread,
event-driven: each step fills every up pool (schedule + submit up to its pipeline depth), then
waits on all pools' sockets at once and updates each pool whose oldest batch came back. A
prefill worker's long iteration therefore never delays the decode worker's next one.

Handoff (a request on a prefill pool):
1. when the batch holding the chunk that ends its prompt is scheduled (before it is sent), blocks
   for the prompt are reserved on a decode pool (Scheduler.reserve_for_handoff; its prefix-cache
   hits there are not sent) and the batch carries a KvSend: src block ids, the decode worker's KV
   address, dst block ids. No room on any decode pool: the request decodes where it was prefilled
   (counted in `num_handoff_no_room`). So decode memory bounds only the transfers in flight, not
   the prompts queued for prefill.
2. the prefill worker computes the chunk, samples the first token (published as index 0 as
   always), sends the blocks worker to worker and waits for the receiver's ack; its reply reports
   the request in kv_sent (seconds, bytes) or kv_failed (reason; the send gives up after
   kv_transfer_timeout_s: the lease on the prefill side's blocks).
3. sent: the prefill pool drops the request without an end event and frees its blocks; the
   decode pool adopts it (running, prompt computed, first token appended) and decodes it; token
   indices continue at 1. A request that ended with its first token (EOS, max_tokens 1) or was
   aborted meanwhile just releases the reservation. Failed: the reservation is released and the
   request is recomputed colocated (kv_transfer_failure "recompute") or ends with an error
   ("fail").

Faults: a pool whose worker is lost (link down, restarted) gives back every request it held:
they are routed again (a request with output tokens colocated; a new one by the router, e.g. to
another prefill pool) and recomputed with the tokens they have; its reservations are released,
and a transfer towards it counts as failed. The pool rejoins once its worker answers. With no
pool up, requests wait up to restart_timeout_s, then end with an error. After every fault each
pool's free blocks return to its total once its requests are gone.

A PoolSet is an engine (scheduler_svc.engine) that the scheduler service runs like an EngineLoop;
its step() applies the fault rules above, so the service never waits for its workers.

Torch-free.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import zmq

from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.remote_executor import WorkerError, WorkerLostError, WorkerRestartedError
from scheduler_svc.request import Request
from scheduler_svc.router import Router
from scheduler_svc.scheduler import Scheduler
from shared.config import cdiv
from shared.messages import Batch, BatchOutput, KvSend, TokenEvent
from shared.sampling import SamplingParams

log = logging.getLogger("sarathi.pools")
service_log = logging.getLogger("sarathi.scheduler")   # what the service sees: a step that raised

FAILURE_MODES = ("recompute", "fail")


@dataclass(eq=False)
class Pool:
    """One worker (replica) under the scheduler. kv_address: where its worker receives KV blocks
    (None: it cannot be a handoff target)."""

    name: str
    role: str
    scheduler: Scheduler
    executor: object
    kv_address: str | None = None
    depth: int = 1
    up: bool = True
    down_since: float | None = None      # time.monotonic() when it went down
    loop: EngineLoop = field(init=False)

    def stats(self) -> dict:
        s = self.scheduler.stats()
        s.update(name=self.name, role=self.role, up=self.up, reserved=len(self.scheduler.reserved))
        return s


@dataclass
class TransferRecord:
    """One handed-off request (seconds on the scheduler's clock, bytes). Its TTFT = queue_s +
    prefill_s + kv_transfer_s (+ the reply's way back): the first token is published once the
    prefill worker's reply came, which is after the send it waited for."""

    req_id: str
    prefill_pool: str
    decode_pool: str
    kv_bytes: int
    kv_transfer_s: float
    queue_s: float
    prefill_s: float

    def as_dict(self) -> dict:
        return dict(req_id=self.req_id, prefill_pool=self.prefill_pool, decode_pool=self.decode_pool,
                    kv_bytes=self.kv_bytes, kv_transfer_s=self.kv_transfer_s, queue_s=self.queue_s,
                    prefill_s=self.prefill_s)


class PoolSet:
    """add_request / abort -> step() -> TokenEvents, over several pools (see the module doc).

    kv_transfer_timeout_s: the lease (seconds) a KvSend may take. kv_transfer_failure:
    "recompute" | "fail". restart_timeout_s: seconds requests wait when no pool is up.
    on_batch(pool, batch, output, seconds) and on_transfer(TransferRecord): metrics hooks.
    """

    def __init__(self, pools: list[Pool], router: Router, *, kv_transfer_timeout_s: float = 10.0,
                 kv_transfer_failure: str = "recompute", restart_timeout_s: float = 30.0,
                 on_batch: Callable | None = None, on_transfer: Callable | None = None,
                 keep_transfers: int = 10000):
        if not pools:
            raise ValueError("at least one pool")
        if kv_transfer_failure not in FAILURE_MODES:
            raise ValueError(f"kv_transfer_failure must be one of {FAILURE_MODES}")
        if len({p.scheduler.block_manager.block_size for p in pools}) != 1:
            raise ValueError("every pool must use the same KV block size")
        self.pools, self.router = pools, router
        self.kv_transfer_timeout_s = kv_transfer_timeout_s
        self.kv_transfer_failure = kv_transfer_failure
        self.restart_timeout_s = restart_timeout_s
        self.on_batch, self.on_transfer = on_batch, on_transfer
        self.clock = pools[0].scheduler.clock
        self.handoffs: dict[str, Pool] = {}       # req_id -> decode pool holding its reservation
        self.orphans: deque[Request] = deque()    # requests with no pool up to run them
        # append-only list (a copy of it is atomic for the HTTP thread), trimmed past 2 x keep
        self.transfers: list[TransferRecord] = []
        self.keep_transfers = keep_transfers
        self._events: list[TokenEvent] = []
        self._last_revive = 0.0
        self.counters = dict(num_handoffs=0, num_kv_failed=0, num_handoff_no_room=0, num_pools_lost=0)
        for p in pools:
            p.loop = EngineLoop(p.scheduler, p.executor, p.depth,
                                on_batch=self._on_batch_hook(p), before_submit=self._kv_sends_hook(p))

    # -- requests in ---------------------------------------------------------------------------
    @property
    def max_num_seqs(self) -> int:
        return sum(p.scheduler.config.max_num_seqs for p in self.pools)

    def add_request(self, req_id: str, prompt_token_ids: list[int],
                    sampling: SamplingParams | None = None, arrival_time: float | None = None,
                    share_prompt_with: str | None = None) -> Request:
        """Route and queue a request (raises InvalidRequestError as Scheduler.add_request)."""
        sampling = SamplingParams() if sampling is None else sampling
        probe = Request(req_id, [int(t) for t in prompt_token_ids], sampling,
                        self.clock() if arrival_time is None else arrival_time)
        if self.owner(req_id) is not None or any(r.req_id == req_id for r in self.orphans):
            self.pools[0].scheduler.validate_request(req_id, prompt_token_ids, sampling)
        pool = self.router.route(self.pools, probe)
        if pool is None:   # nothing up: checked against the first pool, held until one is
            self.pools[0].scheduler.validate_request(req_id, prompt_token_ids, sampling)
            self.orphans.append(probe)
            return probe
        return pool.scheduler.add_request(req_id, prompt_token_ids, sampling, probe.arrival_time,
                                          share_prompt_with)

    def owner(self, req_id: str) -> Pool | None:
        return next((p for p in self.pools if req_id in p.scheduler.requests), None)

    def abort(self, req_id: str, error: str | None = None) -> None:
        """Stop a request at its pool's next step boundary (unknown ids are ignored)."""
        pool = self.owner(req_id)
        if pool is not None:
            pool.scheduler.abort(req_id, error)
            return
        for req in list(self.orphans):
            if req.req_id == req_id:
                self.orphans.remove(req)
                self._events.append(TokenEvent(req_id, req.num_output_tokens, None,
                                               "error" if error else "abort", error, req.num_prompt_tokens))

    def has_unfinished(self) -> bool:
        return bool(self.orphans) or any(p.scheduler.requests for p in self.pools)

    @property
    def num_waiting(self) -> int:
        return len(self.orphans) + sum(len(p.scheduler.waiting) for p in self.pools)

    @property
    def num_running(self) -> int:
        return sum(len(p.scheduler.running) for p in self.pools)

    # -- worker faults, for the scheduler service (see scheduler_svc.engine) ---------------------
    @property
    def worker_up(self) -> bool:
        """Some pool's worker is up."""
        return any(p.up for p in self.pools)

    def check_worker(self) -> bool:
        """Always True: step() notices lost links and asks lost workers back itself."""
        return True

    def wait_for_worker(self) -> list[TokenEvent]:
        return []

    def has_work(self) -> bool:
        """Requests to run, or a lost worker to ask back (step() does both)."""
        return self.has_unfinished() or not all(p.up for p in self.pools)

    def recover(self, error: Exception) -> list[TokenEvent]:
        """After step() raised (a bug: worker faults are handled inside it): no batch in flight
        will be answered and every request ends with an "error" event, returned now."""
        service_log.error("pool step failed", exc_info=error)
        message = f"internal error: {type(error).__name__}: {error}"
        for p in self.pools:
            for lost in p.loop.take_in_flight():
                p.scheduler.fail_batch(lost, message)
            p.scheduler.on_batches_abandoned()
            for req_id in list(p.scheduler.requests):
                p.scheduler.abort(req_id, error=message)
        return [e for p in self.pools for e in p.scheduler.apply_aborts()]

    # -- one step -------------------------------------------------------------------------------
    def step(self, wait_s: float = 0.05) -> list[TokenEvent]:
        """Fill every up pool, wait (up to wait_s) until some pool's oldest batch is back, update
        every pool whose batch is back; returns the token events of this step."""
        self._revive()
        for p in self._up():
            self._check_links(p)
        for p in self._up():
            p.loop.fill()
        ready = self._ready()
        if not ready and any(p.loop.in_flight for p in self._up()):
            self._wait(wait_s)
            ready = self._ready()
        elif not ready and self.orphans:
            time.sleep(wait_s)
        for p in ready:
            self._collect(p)
        for p in self.pools:
            if not p.loop.in_flight:
                self._events += p.scheduler.take_events()   # aborts processed in schedule()
        events, self._events = self._events, []
        return events

    def run_until_done(self, max_steps: int = 100000) -> list[TokenEvent]:
        """Step until nothing is unfinished (tests); all events in order."""
        events: list[TokenEvent] = []
        for _ in range(max_steps):
            if not self.has_unfinished():
                break
            events += self.step()
        events += self.step()   # the last aborts' end events
        return events

    def _up(self) -> list[Pool]:
        return [p for p in self.pools if p.up]

    def _ready(self) -> list[Pool]:
        """Up pools whose oldest batch is back; a pool whose executor reports a failure while
        looking is handled here (its batches are gone)."""
        ready = []
        for p in self._up():
            try:
                if p.loop.head_ready():
                    ready.append(p)
            except (WorkerLostError, WorkerRestartedError) as e:
                self._pool_lost(p, str(e))
            except WorkerError as e:
                log.error("pool %s: iteration failed: %s", p.name, e)
                self._fail_in_flight(p, f"the worker failed this request's iteration: {e}")
        return ready

    def _wait(self, wait_s: float) -> None:
        """Block until a socket of an up pool with a batch in flight is readable, or wait_s."""
        poller, n = zmq.Poller(), 0
        for p in self._up():
            if p.loop.in_flight and hasattr(p.executor, "pollables"):
                for sock in p.executor.pollables():
                    poller.register(sock, zmq.POLLIN)
                    n += 1
        if n:
            poller.poll(int(wait_s * 1000))

    def _collect(self, p: Pool) -> None:
        try:
            batch, output, events = p.loop.collect_one()
        except (WorkerLostError, WorkerRestartedError) as e:
            self._pool_lost(p, str(e))
            return
        except WorkerError as e:
            log.error("pool %s: iteration failed: %s", p.name, e)
            self._fail_in_flight(p, f"the worker failed this request's iteration: {e}")
            return
        self._events += events
        if batch.kv_sends:
            self._finish_handoffs(p, batch, output)

    # -- handoff -----------------------------------------------------------------------------------
    def _kv_sends_hook(self, pool: Pool) -> Callable[[Batch], None]:
        def add_kv_sends(batch: Batch) -> None:
            if pool.role == "prefill":
                self._add_kv_sends(pool, batch)
        return add_kv_sends

    def _add_kv_sends(self, pool: Pool, batch: Batch) -> None:
        """Reserve decode-side blocks for each request whose prompt ends in `batch` and add its
        KvSend (see the module doc, step 1)."""
        bs = pool.scheduler.block_manager.block_size
        for seq in batch.seqs:
            if not seq.sample or seq.output_index != 0 or seq.sampling.max_tokens <= 1:
                continue
            req = pool.scheduler.requests[seq.req_id]
            target = self.router.decode_target(self.pools, pool)
            reserved = target.scheduler.reserve_for_handoff(req) if target is not None else None
            if reserved is None:
                self.counters["num_handoff_no_room"] += 1
                continue
            n, skip = cdiv(req.num_prompt_tokens, bs), reserved.num_computed_tokens // bs
            batch.kv_sends.append(KvSend(req.req_id, list(seq.block_table[skip:n]), target.kv_address,
                                         list(reserved.block_table[skip:n]), self.kv_transfer_timeout_s))
            self.handoffs[req.req_id] = target

    def _finish_handoffs(self, p: Pool, batch: Batch, output: BatchOutput) -> None:
        """After a prefill pool's batch with kv_sends came back (see the module doc, step 3)."""
        for send in batch.kv_sends:
            rid = send.req_id
            target = self.handoffs.pop(rid, None)
            if target is None:
                continue   # cancelled: its batch was lost
            req = p.scheduler.requests.get(rid)
            sent = output.kv_sent.get(rid)
            if req is None:   # ended with its first token, or aborted
                target.scheduler.release_reservation(rid)
            elif sent is not None and target.up and rid in target.scheduler.reserved:
                src = p.scheduler.release_handoff(rid)
                target.scheduler.adopt(src)
                self.counters["num_handoffs"] += 1
                self._record(src, p, target, sent)
            else:
                target.scheduler.release_reservation(rid)
                reason = output.kv_failed.get(rid) or f"the decode worker {target.name} was lost"
                self.counters["num_kv_failed"] += 1
                log.warning("KV transfer of %s to %s failed: %s (%s)", rid, target.name, reason,
                            self.kv_transfer_failure)
                if self.kv_transfer_failure == "fail":
                    p.scheduler.abort(rid, error=f"KV transfer to the decode worker failed: {reason}")
                    self._events += p.scheduler.apply_aborts()
                else:
                    self._reroute([p.scheduler.take_back(rid)])

    def _record(self, req: Request, p: Pool, target: Pool, sent: dict) -> None:
        first = req.first_scheduled_time if req.first_scheduled_time is not None else req.arrival_time
        transfer_s = float(sent.get("kv_transfer_s", 0.0))
        # the batch's reply (so the first token's time here) comes after the send it waited for
        prefill_s = max(0.0, (req.first_token_time or first) - first - transfer_s)
        rec = TransferRecord(req.req_id, p.name, target.name, int(sent.get("kv_bytes", 0)),
                             transfer_s, first - req.arrival_time, prefill_s)
        self.transfers.append(rec)
        if len(self.transfers) > 2 * self.keep_transfers:
            del self.transfers[:-self.keep_transfers]
        if self.on_transfer is not None:
            self.on_transfer(rec)

    # -- faults ------------------------------------------------------------------------------------
    def _check_links(self, p: Pool) -> None:
        check = getattr(p.executor, "check_links", None)
        lost = check() if check is not None else []
        if lost:
            self._pool_lost(p, f"worker {', '.join(lost)} disconnected")

    def _cancel_sends(self, batches: list[Batch]) -> None:
        for b in batches:
            for send in b.kv_sends:
                target = self.handoffs.pop(send.req_id, None)
                if target is not None:
                    target.scheduler.release_reservation(send.req_id)

    def _pool_lost(self, p: Pool, message: str) -> None:
        """p's worker lost its KV: give back every request it held (routed again, recomputed),
        release its reservations (a transfer towards it then fails), wait for it to answer."""
        log.error("pool %s (%s): %s; rerouting its %d requests", p.name, p.role, message,
                  len(p.scheduler.requests))
        self.counters["num_pools_lost"] += 1
        p.up, p.down_since = False, time.monotonic()
        self._cancel_sends(p.loop.take_in_flight())
        s = p.scheduler
        s.on_workers_lost()                # releases its reservations, forgets its prefix cache
        self._events += s.apply_aborts()   # aborts asked before the loss still end these requests
        self._reroute([s.take_back(rid) for rid in list(s.requests)])
        s.take_events()

    def _fail_in_flight(self, p: Pool, message: str) -> None:
        lost = p.loop.take_in_flight()
        self._cancel_sends(lost)
        for b in lost:
            p.scheduler.fail_batch(b, message)
        p.scheduler.on_batches_abandoned()
        self._events += p.scheduler.apply_aborts()

    def _reroute(self, reqs: list[Request | None]) -> None:
        """Queue requests taken back from a pool on the pools the router picks (at the head of
        their waiting queues, oldest first), or hold them while no pool is up."""
        for req in reversed([r for r in reqs if r is not None]):
            pool = self.router.route(self.pools, req)
            if pool is None:
                self.orphans.appendleft(req)
            else:
                pool.scheduler.requeue(req, front=True)

    def _revive(self) -> None:
        """Every 0.5 s: ask down pools whether their worker answers again; place orphans; fail
        them after restart_timeout_s without any pool up."""
        now = time.monotonic()
        if now - self._last_revive < 0.5 and not (self.orphans and self._up()):
            return
        self._last_revive = now
        for p in self.pools:
            if p.up:
                continue
            wait = getattr(p.executor, "wait_ready", None)
            try:
                if wait is not None:
                    wait(0.05)
            except WorkerError:
                continue
            log.info("pool %s answers again", p.name)
            p.up, p.down_since = True, None
            p.kv_address = getattr(p.executor, "kv_address", None) or p.kv_address   # a new port
        if self.orphans and self._up():
            orphans, self.orphans = list(self.orphans), deque()
            self._reroute(orphans)
        elif self.orphans:
            down_s = now - min(p.down_since for p in self.pools if p.down_since is not None)
            if down_s > self.restart_timeout_s:
                message = f"no worker answered for {down_s:.0f} s (restart timeout {self.restart_timeout_s:g} s)"
                for req in self.orphans:
                    self._events.append(TokenEvent(req.req_id, req.num_output_tokens, None, "error",
                                                   message, req.num_prompt_tokens))
                self.orphans.clear()

    # -- metrics --------------------------------------------------------------------------------
    def _on_batch_hook(self, pool: Pool):
        def hook(batch: Batch, output: BatchOutput, seconds: float) -> None:
            if self.on_batch is not None:
                self.on_batch(pool, batch, output, seconds)
        return hook

    def transfer_dicts(self) -> list[dict]:
        """One TransferRecord dict per handed-off request, oldest first (at least the latest
        keep_transfers). Safe to call from another thread."""
        return [t.as_dict() for t in list(self.transfers)]

    def stats(self) -> dict:
        """Totals over the pools (as Scheduler.stats), plus `pools` (one dict each: name, role,
        up, reserved and its Scheduler.stats) and the coordinator's counters (num_handoffs,
        num_kv_failed, num_handoff_no_room, num_pools_lost). Per-request transfers: transfer_dicts()."""
        per = [p.stats() for p in self.pools]
        total = {k: sum(s[k] for s in per) for k in per[0]
                 if isinstance(per[0][k], (int, float)) and not isinstance(per[0][k], bool)}
        total["waiting"] += len(self.orphans)
        total["kv_usage"] = 1 - total["num_free_blocks"] / max(1, total["num_total_blocks"])
        total.update(self.counters, pools=per)
        return total


def make_pool(name: str, role: str, executor, sched_config, max_model_len: int | None,
              clock: Callable[[], float] = time.monotonic) -> Pool:
    """A pool around an executor that has answered (its model_info: blocks, block size, model)."""
    import dataclasses

    from shared.config import CacheConfig

    if sched_config.async_scheduling and role in ("prefill", "decode"):
        raise ValueError("async scheduling does not combine with prefill/decode disaggregation: "
                         "a prompt's last chunk hands its request to another worker, which a "
                         "decode planned ahead on this one would not follow")
    info = executor.model_info
    cfg = dataclasses.replace(sched_config, max_model_len=max_model_len or info.max_model_len)
    scheduler = Scheduler(cfg, CacheConfig(info.block_size, info.num_blocks), info, clock=clock)
    return Pool(name, role, scheduler, executor, kv_address=getattr(executor, "kv_address", None),
                depth=getattr(executor, "pipeline_depth", 1))

"""Simulated worker pools for the disaggregation tests (torch-free): a PoolSet over SimExecutors
that exchange KV blocks through a shared in-process fabric, and a worker that can be lost."""
from __future__ import annotations

from scheduler_svc.pools import Pool, PoolSet
from scheduler_svc.remote_executor import WorkerError, WorkerLostError
from scheduler_svc.router import Router, RouterConfig
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sim_executor import SimClock, SimExecutor
from shared.config import CacheConfig, ModelInfo, SchedulerConfig

BLOCK = 4


class LosableSim(SimExecutor):
    """A simulated worker that can die: lose() makes its next batch raise WorkerLostError and
    wipes its KV (a new process); while `down` it does not answer wait_ready."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.dying, self.down = False, False

    def lose(self) -> None:
        self.dying = True

    def execute(self, batch):
        if self.dying or self.down:
            self.dying, self.down, self.kv = False, True, {}
            raise WorkerLostError("simulated worker death")
        return super().execute(batch)

    def wait_ready(self, timeout_s: float):
        if self.down:
            raise WorkerError("down")
        return None


def make_pools(roles, mode="off", *, threshold=16, num_blocks=64, token_budget=16,
               prefix_caching=False, failure="recompute", margin=2048, max_num_seqs=32,
               backlog_margin=None, scripts=None, async_scheduling=False):
    """A PoolSet with one simulated worker per role (e.g. ["prefill", "decode"]), named p0, p1..."""
    clock, fabric, pools = SimClock(), {}, []
    for i, role in enumerate(roles):
        info = ModelInfo("sim", 256, 500, [0], block_size=BLOCK, num_blocks=num_blocks)
        sched = Scheduler(SchedulerConfig(token_budget=token_budget, max_model_len=256, watermark=0.0,
                                          max_num_seqs=max_num_seqs, enable_prefix_caching=prefix_caching,
                                          async_scheduling=async_scheduling),
                          CacheConfig(BLOCK, num_blocks), info, clock=clock)
        ex = LosableSim(BLOCK, vocab_size=500, scripts=scripts, clock=clock).join_fabric(fabric, f"sim://p{i}")
        pools.append(Pool(f"p{i}", role, sched, ex, kv_address=ex.kv_address))
    router = Router(RouterConfig(mode, threshold, margin if backlog_margin is None else backlog_margin))
    return PoolSet(pools, router, kv_transfer_failure=failure)


def all_free(ps: PoolSet) -> bool:
    return all(p.scheduler.block_manager.num_free_blocks == p.scheduler.block_manager.num_blocks
               and not p.scheduler.reserved for p in ps.pools)


def outputs(events) -> dict[str, list[int]]:
    """req_id -> token ids, checking that each request's indices run 0, 1, 2, ... once each."""
    out: dict[str, list] = {}
    for ev in events:
        toks = out.setdefault(ev.req_id, [])
        if ev.token_id is not None:
            assert ev.index == len(toks), f"{ev.req_id}: index {ev.index} after {len(toks)} tokens"
            toks.append(ev.token_id)
    return out


class SimKvLink:
    """A worker service's KV link for simulated workers in one process (kvstore.link.KvLink's
    interface): sends copy slots into the receiving SimExecutor found in `fabric`."""

    def __init__(self, executor: SimExecutor, fabric: dict, address: str | None):
        self.executor, self.fabric, self.address = executor, fabric, address
        if address:
            executor.join_fabric(fabric, address)

    def send(self, src_blocks, dst_address, dst_blocks, timeout_s, req_id=""):
        dst = self.fabric[dst_address]
        for s, d in zip(src_blocks, dst_blocks):
            dst.kv[d] = list(self.executor.kv.get(s, [None] * self.executor.block_size))
        dst.kv_blocks_received += len(dst_blocks)
        return 0.0, len(src_blocks) * self.executor.block_size

    def close(self):
        pass

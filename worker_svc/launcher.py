"""Start every rank of a tensor/pipeline-parallel worker replica on this machine.

`sarathi worker --tp T --pp P` (without --rank and without RANK in the environment) runs
`launch_local`: it checks the layout against the model's config (before any weight is read),
hosts the rendezvous store on a free loopback port (host_store), and spawns T x P processes,
one per rank, each serving its ZeroMQ socket at shared.config.rank_address(bind, rank). Like
torchrun, the replica lives and dies as one: when any rank exits (crash, or a rank that saw a
peer die and stopped), the others are terminated and the launcher exits with that rank's code,
so a supervisor (compose restart policy, a Kubernetes pod) restarts the whole replica. SIGTERM /
Ctrl-C stop every rank. The ranks inherit this process's environment, link keys included
(SARATHI_LINK_*, see shared.link_auth): every rank's socket is authenticated like a single
worker's.

For several machines, start one process per rank instead (`sarathi worker --tp T --pp P --rank
R --master-addr A`, or under torchrun, which sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from dataclasses import replace
from multiprocessing.connection import wait

from shared.config import ParallelConfig, WorkerServiceConfig

log = logging.getLogger("sarathi.worker")


def host_store(world_size: int, port: int = 0, timeout_s: float = 60.0):
    """The replica's torch.distributed rendezvous store (a TCPStore server), hosted by the
    launcher for the ranks it starts on this machine: a socket bound to 127.0.0.1:port (0: a
    free one) and listening before any rank starts, handed to the TCPStore server as its
    listening socket. Bound here, the port cannot be taken by another process before the ranks
    use it (a port chosen here and bound by rank 0 seconds later could be), and on loopback
    nothing off this machine can reach the store (rank 0's own store listens on every
    interface). The store owns the socket from then on (it closes it when it goes): keep it for
    the replica's life. Its port is store.port."""
    import datetime

    import torch.distributed as dist

    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen(max(128, 2 * world_size))
        store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], world_size, is_master=True,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()      # the store's server listens on this descriptor and closes it
    return store


def launch_local(config: WorkerServiceConfig) -> int:
    """Run every rank of config.parallel (its rank ignored) with run_worker, one process each;
    returns the exit code of the first rank to exit (0 when stopped by a signal)."""
    from shared.model_source import resolve_model
    from worker_svc import parallel as par
    from worker_svc.loader import read_config

    parallel = config.parallel
    par.check(read_config(resolve_model(config.engine.model)), parallel)
    store = host_store(parallel.world_size, parallel.master_port, parallel.timeout_s)
    parallel = replace(parallel, master_addr="127.0.0.1", master_port=store.port, store_hosted=True)
    ctx = mp.get_context("spawn")   # not fork: each rank starts clean (threads, torch state)
    procs = [ctx.Process(target=_rank_main, name=f"sarathi-rank{r}", daemon=False,
                         args=(_rank_config(config, replace(parallel, rank=r)), os.getpid()))
             for r in range(parallel.world_size)]
    for p in procs:
        p.start()
    log.info("started %d ranks (tp %d x pp %d): pids %s", len(procs), parallel.tp, parallel.pp,
             [p.pid for p in procs])
    stopping = threading.Event()

    def on_signal(signum, _frame):
        stopping.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        while not stopping.is_set():
            done = wait([p.sentinel for p in procs], timeout=0.5)
            if done:
                dead = next(p for p in procs if p.sentinel in done)
                dead.join()
                code = dead.exitcode if dead.exitcode else 1
                log.error("%s (pid %d) exited with code %s: stopping the replica", dead.name,
                          dead.pid, dead.exitcode)
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 10
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        for s, h in old.items():
            signal.signal(s, h)
        del store           # stops listening
    return code


def _rank_config(config: WorkerServiceConfig, parallel: ParallelConfig) -> WorkerServiceConfig:
    """Rank `parallel.rank`'s config: its place in the replica, and on CUDA its own GPU."""
    engine = config.engine
    if engine.device == "cuda":    # one GPU per rank of this machine
        engine = replace(engine, device=f"cuda:{parallel.rank}")
    return replace(config, engine=engine, parallel=parallel)


def _rank_main(config: WorkerServiceConfig, parent_pid: int) -> None:
    """One rank: serve until stopped; exit when the launcher is gone (even if SIGKILLed)."""
    from worker_svc.service import run_worker, stop_when_parent_exits

    rank = config.parallel.rank
    logging.basicConfig(level="INFO", format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    stop = stop_when_parent_exits(parent_pid)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    run_worker(config, stop=stop)

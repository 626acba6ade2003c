"""The end-to-end tests' deployments, as real processes on free ports:

Each is started with the real `sarathi` command line, configured through SARATHI_<OPTION>
environment variables as docker-compose and k8s do.

* `EmbeddedStack`: `sarathi serve` in one child process (gateway + scheduler thread + worker
  grandchild; the in-process queue, or Redis when given a URL); GET /metrics shows gateway and
  scheduler metrics.
* `DistributedStack`: `sarathi worker`, `sarathi scheduler` and `sarathi gateway` as three
  processes around a real Redis (keys under a prefix of their own), ZeroMQ over
  tcp://127.0.0.1; the scheduler can be SIGKILLed and restarted under the same consumer name.

Both expose `base_url` (the OpenAI API root) and `metrics_urls` (where the Prometheus text of the
scheduler and the gateway can be read). Logs go to files under a temp dir; a failing start
prints their tails.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.support.redis_fixture import free_port

ROOT = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 256      # KV blocks of 16 tokens: plenty for 64 short requests, small to allocate
MAX_MODEL_LEN = 1024  # tokens: an over-long prompt is cheap to build


def spawn(command: str, options: dict, log: Path) -> subprocess.Popen:
    """`sarathi <command>` configured like a container: every option a SARATHI_<OPTION> env var."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SARATHI_")}  # only ours count
    env["PYTHONUNBUFFERED"] = "1"
    env.update({"SARATHI_" + k.upper(): str(v) for k, v in options.items()})
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "sarathi.cli", command], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


def wait_ready(url: str, procs: list[subprocess.Popen], logs: list[Path], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while get(url)[0] != 200:
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs if log.exists())
            raise RuntimeError(f"{url} not ready (exited: {[p.args[-1] for p in dead]})\n{tails}")
        time.sleep(0.25)


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text (0.0 when absent)."""
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


class EmbeddedStack:
    """redis_url None: the in-process queue; else Redis, keys under `prefix`. options: more
    `sarathi serve` options (e.g. worker_restart_timeout, drain_timeout)."""

    def __init__(self, tmp: Path, redis_url: str | None = None, prefix: str = "sarathi:", **options):
        self.mode = "embedded" if redis_url is None else "embedded-redis"
        self.prefix = prefix
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.metrics_urls = [f"http://127.0.0.1:{self.port}/metrics"]
        self.scheduler_metrics_url = self.metrics_urls[0]
        self.logs = [tmp / "embedded.log"]
        options = {**dict(port=self.port, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN,
                          queue_prefix=prefix, **({"redis_url": redis_url} if redis_url else {})), **options}
        self.proc = spawn("serve", options, self.logs[0])
        wait_ready(f"http://127.0.0.1:{self.port}/ready", [self.proc], self.logs)

    @property
    def gateway_proc(self) -> subprocess.Popen:
        return self.proc

    def wait(self) -> None:
        wait_ready(f"http://127.0.0.1:{self.port}/ready", [self.proc], self.logs)

    def worker_pid(self) -> int:
        """The worker child's pid, from the serve log (it logs each worker it starts)."""
        pids = re.findall(r"worker process started \(pid (\d+)\)", self.logs[0].read_text())
        return int(pids[-1])

    def kill_worker(self) -> None:
        """SIGKILL the worker process; `sarathi serve` starts a new one."""
        os.kill(self.worker_pid(), signal.SIGKILL)

    def close(self) -> None:
        stop(self.proc)


class DistributedStack:
    mode = "distributed-redis"

    def __init__(self, tmp: Path, redis_url: str, prefix: str, scheduler_options: dict | None = None,
                 gateway_options: dict | None = None):
        self.redis_url, self.prefix = redis_url, prefix
        self.scheduler_options, gateway_options = scheduler_options or {}, gateway_options or {}
        self.gw_port, self.metrics_port, zmq_port = free_port(), free_port(), free_port()
        self.worker_addr = f"tcp://127.0.0.1:{zmq_port}"
        self.base_url = f"http://127.0.0.1:{self.gw_port}/v1"
        self.scheduler_metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.metrics_urls = [self.scheduler_metrics_url, f"http://127.0.0.1:{self.gw_port}/metrics"]
        self.logs = [tmp / "worker.log", tmp / "scheduler.log", tmp / "gateway.log"]
        self.worker = spawn("worker", dict(bind=self.worker_addr, num_blocks=NUM_BLOCKS), self.logs[0])
        self.scheduler = self._start_scheduler()
        self.gateway = spawn("gateway", dict(redis_url=redis_url, port=self.gw_port, queue_prefix=prefix,
                                             max_model_len=MAX_MODEL_LEN, **gateway_options), self.logs[2])
        self.wait()

    @property
    def gateway_proc(self) -> subprocess.Popen:
        return self.gateway

    def kill_worker(self) -> None:
        """SIGKILL the worker; nothing restarts it until start_worker()."""
        stop(self.worker, signal.SIGKILL)

    def start_worker(self) -> None:
        self.worker = spawn("worker", dict(bind=self.worker_addr, num_blocks=NUM_BLOCKS), self.logs[0])

    def _start_scheduler(self) -> subprocess.Popen:
        return spawn("scheduler", dict(redis_url=self.redis_url, worker_addr=self.worker_addr,
                                       metrics_port=self.metrics_port, queue_prefix=self.prefix,
                                       consumer="e2e-scheduler", max_model_len=MAX_MODEL_LEN,
                                       **self.scheduler_options), self.logs[1])

    def wait(self) -> None:
        procs = [self.worker, self.scheduler, self.gateway]
        wait_ready(self.scheduler_metrics_url.replace("/metrics", "/ready"), procs, self.logs)
        wait_ready(f"http://127.0.0.1:{self.gw_port}/ready", procs, self.logs)

    def kill_and_restart_scheduler(self) -> None:
        """SIGKILL: no cleanup, no acks; the new process replays the pending requests."""
        stop(self.scheduler, signal.SIGKILL)
        self.scheduler = self._start_scheduler()
        self.wait()

    def close(self) -> None:
        for p in (self.gateway, self.scheduler, self.worker):
            stop(p)

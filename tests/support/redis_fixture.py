"""A Redis for tests: the one on 127.0.0.1:6379 when it answers, else a `redis-server` started
on a free port for the session. Each test gets its own key prefix (and its keys are deleted
afterwards), so tests never clash with each other or with a running deployment.

Override the server with SARATHI_TEST_REDIS_URL.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid

import pytest
import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="session")
def redis_server_url():
    url = os.environ.get("SARATHI_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    if _answers(url):
        yield url
        return
    if shutil.which("redis-server") is None:
        pytest.skip("no Redis answers and redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while not _answers(url):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"redis-server did not start on port {port}")
        time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def new_prefix() -> str:
    return f"test:{uuid.uuid4().hex[:10]}:"


def delete_prefix(url: str, prefix: str) -> None:
    r = redis.Redis.from_url(url)
    keys = list(r.scan_iter(match=prefix + "*", count=1000))
    if keys:
        r.delete(*keys)
    r.close()


@pytest.fixture
def redis_prefix(redis_server_url):
    """A key prefix of this test's own; its keys are removed at the end."""
    prefix = new_prefix()
    yield prefix
    delete_prefix(redis_server_url, prefix)


class RedisServer:
    """A private `redis-server` on a free port (no persistence), for tests that restart it:
    restart() stops it and starts a new, empty instance on the same port."""

    def __init__(self):
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not _answers(self.url):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.proc.kill()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

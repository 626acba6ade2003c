"""Redis with a password and TLS, against real `redis-server` processes started here: a wrong or
missing password is refused, the right one (from a file, as a mounted Secret gives it) works for
both sides of the queue, `rediss://` verifies the server's certificate, and the request stream
is bounded."""
from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import httpx
import pytest
import redis

from shared.messages import RequestMsg, TokenEvent
from shared.queue import QueueConfig, QueueFullError, make_queues
from shared.queue.local import LocalBroker, LocalGatewayQueue
from shared.queue.redis_streams import auth_options
from shared.sampling import SamplingParams
from tests.support.redis_fixture import free_port

PASSWORD = "s3cret-for-this-test-only"


def _req(req_id: str, gw: str) -> RequestMsg:
    return RequestMsg(req_id, [1, 2, 3], SamplingParams(max_tokens=2), gw, time.time())


def _start(args: list[str], ping) -> subprocess.Popen:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        try:
            if ping():
                return proc
        except redis.RedisError:
            pass
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace")
            if "tls" in out.lower() and ("not supported" in out.lower() or "Bad directive" in out):
                pytest.skip("this redis-server has no TLS support")
            pytest.fail(f"redis-server exited: {out[-500:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("redis-server did not start")
        time.sleep(0.05)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def auth_redis():
    port = free_port()
    proc = _start(["--port", str(port), "--requirepass", PASSWORD],
                  lambda: redis.Redis(port=port, password=PASSWORD, socket_timeout=0.5).ping())
    yield port
    _stop(proc)


def _roundtrip(url: str, prefix: str) -> list[TokenEvent]:
    """Submit, fetch, publish and read back one event through both sides of the queue."""
    cfg = QueueConfig(prefix=prefix)
    gq, sq = make_queues(url, config=cfg, gateway_id="gw", consumer="s1")

    async def main():
        stream = gq.events()
        try:
            await gq.submit(_req("r1", "gw"))
            (msg,) = await asyncio.to_thread(sq.fetch, 1)
            sq.publish([TokenEvent(msg.req_id, 0, 42, "length")])
            return [await asyncio.wait_for(anext(stream), 5)]
        finally:
            await stream.aclose()
            await gq.close()
            sq.close()
    return asyncio.run(main())


def test_a_wrong_or_missing_password_is_refused(auth_redis, monkeypatch):
    monkeypatch.delenv("SARATHI_REDIS_PASSWORD", raising=False)
    monkeypatch.delenv("SARATHI_REDIS_PASSWORD_FILE", raising=False)
    with pytest.raises(redis.AuthenticationError):
        _roundtrip(f"redis://:wrong@127.0.0.1:{auth_redis}/0", "t:wrong:")
    with pytest.raises(redis.AuthenticationError):
        make_queues(f"redis://127.0.0.1:{auth_redis}/0", config=QueueConfig(prefix="t:none:"))
    monkeypatch.setenv("SARATHI_REDIS_PASSWORD", "also-wrong")
    with pytest.raises(redis.AuthenticationError):
        make_queues(f"redis://127.0.0.1:{auth_redis}/0", config=QueueConfig(prefix="t:env:"))


def test_the_password_from_a_secret_file_works_for_both_sides(auth_redis, monkeypatch, tmp_path):
    secret = tmp_path / "redis-password"
    secret.write_text(PASSWORD + "\n")  # as `kubectl create secret --from-file` may leave it
    monkeypatch.setenv("SARATHI_REDIS_PASSWORD_FILE", str(secret))
    monkeypatch.setenv("SARATHI_REDIS_PASSWORD", "ignored-when-a-file-is-named")
    (ev,) = _roundtrip(f"redis://127.0.0.1:{auth_redis}/0", "t:file:")
    assert (ev.req_id, ev.token_id, ev.finish_reason, ev.epoch) == ("r1", 42, "length", 1)


def test_a_named_but_missing_password_file_fails_at_start(tmp_path):
    with pytest.raises(FileNotFoundError):
        auth_options("redis://127.0.0.1:1/0", {"SARATHI_REDIS_PASSWORD_FILE": str(tmp_path / "absent")})
    # a password in the URL wins; TLS options only for rediss://
    assert auth_options("redis://:inurl@h:1/0", {"SARATHI_REDIS_PASSWORD": "env"}) == {}
    assert "ssl_ca_certs" not in auth_options("redis://h:1/0", {"SARATHI_REDIS_TLS_CA_FILE": "/ca"})
    assert auth_options("rediss://h:1/0", {"SARATHI_REDIS_TLS_CA_FILE": "/ca"})["ssl_ca_certs"] == "/ca"


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """A redis-server that speaks only TLS (and wants the password), with a throwaway CA."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=test-ca",
             cwd=d)
    _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost", cwd=d)
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "1", "-extfile", "san.ext", cwd=d)
    port = free_port()
    proc = _start(["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(d / "server.crt"),
                   "--tls-key-file", str(d / "server.key"), "--tls-ca-cert-file", str(d / "ca.crt"),
                   "--tls-auth-clients", "no", "--requirepass", PASSWORD],
                  lambda: redis.Redis(port=port, password=PASSWORD, ssl=True, ssl_ca_certs=str(d / "ca.crt"),
                                      socket_timeout=0.5).ping())
    yield port, d / "ca.crt"
    _stop(proc)


def test_rediss_with_the_ca_works_and_an_unverified_server_is_refused(tls_redis, monkeypatch, tmp_path):
    port, ca = tls_redis
    secret = tmp_path / "pw"
    secret.write_text(PASSWORD)
    monkeypatch.setenv("SARATHI_REDIS_PASSWORD_FILE", str(secret))
    monkeypatch.setenv("SARATHI_REDIS_TLS_CA_FILE", str(ca))
    (ev,) = _roundtrip(f"rediss://localhost:{port}/0", "t:tls:")
    assert (ev.req_id, ev.token_id) == ("r1", 42)
    with pytest.raises(redis.ConnectionError):  # plain text to the TLS port gets nowhere
        make_queues(f"redis://localhost:{port}/0", config=QueueConfig(prefix="t:plain:"))
    monkeypatch.delenv("SARATHI_REDIS_TLS_CA_FILE")  # the system CAs do not know this server
    with pytest.raises(redis.ConnectionError):
        make_queues(f"rediss://localhost:{port}/0", config=QueueConfig(prefix="t:noca:"))


def test_the_request_stream_is_bounded(auth_redis, monkeypatch):
    monkeypatch.setenv("SARATHI_REDIS_PASSWORD", PASSWORD)
    cfg = QueueConfig(prefix="t:bound:", requests_maxlen=3)
    gq, sq = make_queues(f"redis://127.0.0.1:{auth_redis}/0", config=cfg, gateway_id="gw", consumer="s1")
    r = redis.Redis(port=auth_redis, password=PASSWORD)

    async def main():
        for i in range(3):
            await gq.submit(_req(f"r{i}", "gw"))
        with pytest.raises(QueueFullError):
            await gq.submit(_req("r3", "gw"))
        assert r.xlen(cfg.requests_key) == 3
        taken = await asyncio.to_thread(sq.fetch, 1)  # taken but not acked: still counts
        with pytest.raises(QueueFullError):
            await gq.submit(_req("r3", "gw"))
        sq.ack(taken[0].req_id)
        await gq.submit(_req("r3", "gw"))  # room again
        await gq.close()
    try:
        asyncio.run(main())
    finally:
        sq.close()
        r.delete(*r.keys("t:bound:*"))


def test_the_in_process_queue_is_bounded_too():
    broker = LocalBroker(QueueConfig(requests_maxlen=2))
    gq = LocalGatewayQueue(broker, "gw")

    async def main():
        await gq.submit(_req("a", "gw"))
        await gq.submit(_req("b", "gw"))
        with pytest.raises(QueueFullError):
            await gq.submit(_req("c", "gw"))
    asyncio.run(main())
    assert [r.req_id for r in broker.waiting] == ["a", "b"]


def test_a_full_request_stream_is_a_503_at_the_gateway(make_stack):
    """Through the real gateway app (uvicorn): the bound is an answer, not a growing Redis."""
    stack = make_stack(backend="redis", admitting=False)
    stack.queue_config.requests_maxlen = 2  # the gateway's queue shares this config object
    stack.prefill(2)
    resp = httpx.post(stack.url + "/v1/completions", json={"model": "smol-test", "prompt": "x", "max_tokens": 2})
    assert resp.status_code == 503

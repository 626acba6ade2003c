"""Who may use the gateway: an API key is needed to serve on a non-loopback address (or an
explicit, loudly logged opt-out); with a key, /v1/* and /metrics answer 401 without it; /health
and /ready stay open for probes, and no answer carries exception text. Real processes and a
real uvicorn server."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import httpx
import pytest

from gateway.server import UnauthenticatedBindError, check_exposure, is_loopback, read_api_key
from tests.support.redis_fixture import free_port

KEY = "s3cret-key"
MSG = [{"role": "user", "content": "Hi"}]


def sarathi(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sarathi", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})


def test_the_gateway_refuses_a_public_bind_without_a_key():
    proc = sarathi("gateway", "--host", "0.0.0.0", "--port", str(free_port()),
                   "--redis-url", "redis://127.0.0.1:1/0")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert "without an API key" in out and "--allow-unauthenticated" in out


def test_the_opt_out_serves_and_says_so_loudly(redis_server_url):
    port = free_port()
    proc = sarathi("gateway", "--host", "0.0.0.0", "--port", str(port), "--redis-url", redis_server_url,
                   "--allow-unauthenticated")
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "WITHOUT an API key" in line or not line:
                break
        assert any("SECURITY" in ln and "WITHOUT an API key" in ln for ln in lines), "".join(lines)
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_key_file_from_the_environment_opens_a_public_bind(redis_server_url, tmp_path):
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    port = free_port()
    proc = sarathi("gateway", "--host", "0.0.0.0", "--port", str(port), "--redis-url", redis_server_url,
                   env={"SARATHI_API_KEY_FILE": str(key_file)})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert "SECURITY" not in out


def test_loopback_binds_need_no_key_and_names_count_as_public():
    for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.3.4.5"):
        assert is_loopback(host)
        check_exposure(host, has_api_key=False)
    for host in ("0.0.0.0", "::", "10.0.0.7", "gateway.internal"):
        assert not is_loopback(host)
        with pytest.raises(UnauthenticatedBindError):
            check_exposure(host, has_api_key=False)
        check_exposure(host, has_api_key=True)


def test_the_opt_out_logs_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="gateway.server"):
        check_exposure("0.0.0.0", has_api_key=False, allow_unauthenticated=True)
    assert any(r.levelno == logging.WARNING and "WITHOUT an API key" in r.getMessage() for r in caplog.records)


def test_the_key_comes_from_a_file_a_flag_or_nowhere(tmp_path):
    f = tmp_path / "key"
    f.write_text(f"  {KEY}\n")
    assert read_api_key(None, str(f)) == KEY
    assert read_api_key(KEY, None) == KEY
    assert read_api_key(None, None) is None
    with pytest.raises(ValueError):
        read_api_key(KEY, str(f))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError):
        read_api_key(None, str(tmp_path / "empty"))


@pytest.fixture
def keyed(make_stack):
    return make_stack(api_key=KEY)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
def test_a_missing_or_wrong_key_is_401_on_the_api_and_metrics(keyed, headers):
    for method, path, body in (("GET", "/v1/models", None), ("GET", "/metrics", None),
                               ("POST", "/v1/chat/completions", {"messages": MSG, "max_tokens": 2}),
                               ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})):
        r = httpx.request(method, keyed.url + path, json=body, headers=headers)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["WWW-Authenticate"] == "Bearer"


def test_the_right_key_opens_the_api_and_metrics_and_probes_need_none(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(keyed.url + "/metrics", headers=auth).status_code == 200
    assert httpx.get(keyed.url + "/v1/models", headers=auth).status_code == 200
    r = httpx.post(keyed.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 4}, headers=auth)
    assert r.status_code == 200, r.text
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/ready").status_code in (200, 503)


def test_ready_answers_no_exception_text(make_stack):
    async def failing() -> bool:
        raise ConnectionError("redis://:hunter2@10.1.2.3:6379 refused")

    stack = make_stack(ready_check=failing)
    r = httpx.get(stack.url + "/ready")
    assert r.status_code == 503
    assert "hunter2" not in r.text and "10.1.2.3" not in r.text and "refused" not in r.text
    assert r.json()["status"] == "not ready"


def test_a_broken_queue_answers_no_exception_text(make_stack):
    stack = make_stack()

    async def broken() -> int:
        raise ConnectionError("redis://:hunter2@10.1.2.3:6379 refused")

    stack.server.server.config.app.state.queue.depth = broken
    r = httpx.post(stack.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_unavailable"
    assert "hunter2" not in r.text and "10.1.2.3" not in r.text


def test_a_failed_generation_answers_no_exception_text(make_stack):
    from tests.support.gateway_fakes import Plan

    leak = "internal error: OSError: [Errno 13] /srv/secret/weights.bin"
    stack = make_stack(plan=lambda req: Plan("Hi", error_after=1))
    original = stack.fake.events_for

    def events(req, plan):   # the error event carries an exception's text, as the scheduler's may
        evs = original(req, plan)
        evs[-1].error = leak
        return evs

    stack.fake.events_for = events
    r = httpx.post(stack.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=20)
    assert r.status_code == 500 and r.json()["error"]["code"] == "generation_error"
    assert "secret" not in r.text and "Errno" not in r.text and "internal error" in r.text

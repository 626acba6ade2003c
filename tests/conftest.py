"""Fixtures every test module may use. Keep this small; specific helpers live beside their tests."""
import pytest

from tests.redis_fixture import redis_prefix, redis_server_url  # noqa: F401 (fixtures)


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """A clean native-kernel build state in an empty cache dir; restored afterwards."""
    from worker_svc.backends.cpu import native

    monkeypatch.setenv("SARATHI_CACHE_DIR", str(tmp_path))
    native._reset()
    yield
    monkeypatch.undo()
    native._reset()
    native.available()

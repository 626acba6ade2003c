"""Fixtures every test module may use. Tests are grouped by component (gateway/, queue/,
scheduler/, worker/, kvstore/, measure/, e2e/, gpu/, shared/); what several of them share lives in
tests/support/. The fixtures of support modules are registered here as plugins, so a test names
a fixture without importing it."""
import pytest

pytest_plugins = ["tests.support.redis_fixture", "tests.support.gateway_fakes"]


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

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


@pytest.fixture(autouse=True)
def _sarathi_environment_restored():
    """Each test leaves the process's SARATHI_* environment as it found it. Code under test may
    write it on purpose (the CLI's --link-keys gives the process and its children the keys), and
    a variable left behind changes every later test of the session (a scheduler with keys its
    workers lack); the link keys this process read from it are forgotten with it."""
    import os

    before = {k: v for k, v in os.environ.items() if k.startswith("SARATHI_")}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith("SARATHI_")}
    if after != before:
        for k in after.keys() - before.keys():
            del os.environ[k]
        os.environ.update(before)
        from shared import link_auth

        link_auth._process_keys.clear()


def pytest_collection_modifyitems(items):
    """Give schemathesis' per-operation items the node ids their names already carry. They share
    one node id (test_fuzz.py::test_...), and pytest-xdist schedules by node id: without this, a
    parallel run runs one operation of seven."""
    for item in items:
        if type(item).__name__ == "SchemathesisFunction" and "[" in item.name and "[" not in item.nodeid:
            operation = item.name.split("[", 1)[1].removesuffix("]")
            if hasattr(getattr(item, "_id", None), "with_params"):   # pytest >= 9: a NodeId object
                item._id = item._id.with_params(operation)
            else:
                item._nodeid = f"{item.nodeid}[{operation}]"

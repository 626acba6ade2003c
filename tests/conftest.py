"""Fixtures every test module may use. Keep this small; specific helpers live beside their tests."""
from tests.redis_fixture import redis_prefix, redis_server_url  # noqa: F401 (fixtures)

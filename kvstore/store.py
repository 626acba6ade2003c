"""Key -> bytes stores for KV blocks moved out of (and back into) a worker.

Keys name what the bytes hold (see `block_key`, `prefix_key`); values are opaque payloads made
by kvstore.transfer. Two stores with one interface: in-process (LRU, bounded in bytes) and
Redis (shared by replicas, bounded by a TTL). Torch-free.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol


def block_key(req_id: str, first_block: int, num_blocks: int) -> str:
    """Blocks first_block .. first_block + num_blocks - 1 (logical indices) of one request."""
    return f"req:{req_id}:{first_block}+{num_blocks}"


def prefix_key(chain_hash: int, model: str) -> str:
    """One full block found by its chained prefix hash (scheduler_svc.prefix_cache.chain_hash).
    The model name is part of the key: the same tokens give different KV in another model."""
    return f"prefix:{model}:{chain_hash & (2**64 - 1):016x}"


class KVStore(Protocol):
    def put(self, key: str, payload: bytes) -> None: ...
    def get(self, key: str) -> bytes | None: ...
    def delete(self, key: str) -> None: ...


class MemoryKVStore:
    """In-process store that evicts least-recently-used entries beyond capacity_bytes.
    Thread-safe: a worker may export on its loop thread while another thread reads."""

    def __init__(self, capacity_bytes: int = 1 << 30):
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, key: str, payload: bytes) -> None:
        if len(payload) > self.capacity_bytes:
            raise ValueError(f"payload of {len(payload)} bytes exceeds the store's capacity "
                             f"of {self.capacity_bytes} bytes")
        with self._lock:
            self._drop(key)
            self._items[key] = payload
            self.used_bytes += len(payload)
            while self.used_bytes > self.capacity_bytes:
                self._drop(next(iter(self._items)))

    def get(self, key: str) -> bytes | None:
        with self._lock:
            payload = self._items.get(key)
            if payload is not None:
                self._items.move_to_end(key)
            return payload

    def delete(self, key: str) -> None:
        with self._lock:
            self._drop(key)

    def __len__(self) -> int:
        return len(self._items)

    def _drop(self, key: str) -> None:
        payload = self._items.pop(key, None)
        if payload is not None:
            self.used_bytes -= len(payload)


class RedisKVStore:
    """Redis-backed store, shared by replicas. ttl_s bounds how long an unused entry lives."""

    def __init__(self, url: str, namespace: str = "sarathi:kv", ttl_s: int = 3600):
        import redis  # only this store needs the client

        from shared.queue import redis_auth_options  # the deployment's Redis password and TLS
        self._r = redis.Redis.from_url(url, **redis_auth_options(url))
        self.namespace = namespace
        self.ttl_s = ttl_s

    def put(self, key: str, payload: bytes) -> None:
        self._r.set(f"{self.namespace}:{key}", payload, ex=self.ttl_s)

    def get(self, key: str) -> bytes | None:
        return self._r.get(f"{self.namespace}:{key}")

    def delete(self, key: str) -> None:
        self._r.delete(f"{self.namespace}:{key}")

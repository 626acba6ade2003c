"""KV blocks leave one worker as bytes and continue the same generation in another worker,
under other block ids (the prefill/decode disaggregation seam)."""
import pytest

from kvstore.store import MemoryKVStore, RedisKVStore, block_key, prefix_key
from kvstore.transfer import export_blocks, import_blocks
from shared.messages import Batch
from tests.support.engine_helpers import chunk, greedy_generate, make_executor, make_tiny_checkpoint

PROMPT = [(11 * i) % 200 + 3 for i in range(37)]  # 37 tokens: 3 blocks of 16, the last partial
BS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("kv"), "llama")


def decode_from(ex, first_token: int, table: list[int], n: int) -> list[int]:
    out = [first_token]
    while len(out) < n:
        pos = len(PROMPT) + len(out) - 1
        res = ex.execute(Batch(1, [chunk("g", [out[-1]], pos, table, True, output_index=len(out))]))
        out.append(res.sampled["g"])
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_moved_to_another_worker_continue_the_same_generation(model, dtype):
    prefill_worker, decode_worker = make_executor(model, dtype, 32), make_executor(model, dtype, 32)
    expected = greedy_generate(make_executor(model, dtype, 32), PROMPT, 10, [0, 1, 2, 3])

    first = prefill_worker.execute(Batch(0, [chunk("g", PROMPT, 0, [4, 5, 6, 7], True)])).sampled["g"]
    store = MemoryKVStore()
    store.put(block_key("g", 0, 3), export_blocks(prefill_worker.cache, [4, 5, 6]))
    import_blocks(decode_worker.cache, [30, 2, 17], store.get(block_key("g", 0, 3)))

    assert decode_from(decode_worker, first, [30, 2, 17, 9], 10) == expected


def test_a_payload_that_does_not_fit_is_refused_and_nothing_is_written(model):
    a, b = make_executor(model, "float32", 8), make_executor(model, "bfloat16", 8)
    a.execute(Batch(0, [chunk("g", PROMPT[:16], 0, [0], True)]))
    payload = export_blocks(a.cache, [0])
    before = b.cache.k[0].clone()
    with pytest.raises(ValueError, match="does not fit"):
        import_blocks(b.cache, [1], payload)          # other dtype
    with pytest.raises(ValueError, match="does not fit"):
        import_blocks(a.cache, [1, 2], payload)       # other number of blocks
    with pytest.raises(ValueError, match="magic"):
        import_blocks(a.cache, [1], b"\x80")          # not a payload at all
    assert b.cache.k[0].equal(before)


def test_memory_store_evicts_least_recently_used_beyond_capacity():
    store = MemoryKVStore(capacity_bytes=10)
    store.put("a", b"1234")
    store.put("b", b"5678")
    assert store.get("a") == b"1234"                 # a is now the most recently used
    store.put("c", b"9abc")
    assert store.get("b") is None and store.get("a") == b"1234" and store.get("c") == b"9abc"
    assert store.used_bytes == 8
    with pytest.raises(ValueError, match="capacity"):
        store.put("huge", b"x" * 11)


def test_redis_store_round_trips_and_deletes(redis_server_url, redis_prefix):
    store = RedisKVStore(redis_server_url, namespace=redis_prefix + "kv", ttl_s=60)
    key = prefix_key(-12345, "tiny")
    store.put(key, b"\x00payload\xff")
    assert store.get(key) == b"\x00payload\xff"
    store.delete(key)
    assert store.get(key) is None

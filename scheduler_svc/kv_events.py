"""KV-cache events in vLLM's wire format, from the scheduler's block manager.

A prefix-cache-aware router (the inference gateway's precise prefix-cache scorer, llm-d's KV
indexer, Dynamo's or SGLang's router) follows what each replica's KV cache holds through these
events, unmodified, because they are what vLLM publishes:

* ``BlockStored``: full blocks whose K/V are now computed and findable by their hash:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name]``; the hashes of consecutive blocks of one request, the hash of the block before the
  first (None for a request's first block), every token of those blocks in order.
* ``BlockRemoved``: blocks evicted (handed out for new content): ``["BlockRemoved",
  block_hashes, medium]``.
* ``AllBlocksCleared``: nothing cached is findable any more (the worker restarted and lost its
  KV tensors): ``["AllBlocksCleared"]``.

Each event is a msgpack array whose first element is the type's tag (msgspec's ``array_like``
tagged structs); events go out in batches ``[ts, events, data_parallel_rank]`` (ts: seconds since
the epoch). Transport: a ZeroMQ PUB socket sends ``(topic, seq, payload)`` per batch, seq an
8-byte big-endian counter from 0; a ROUTER socket answers a replay request ``(identity, b"",
start_seq)`` with every buffered batch ``(identity, b"", seq, payload)`` whose seq >= start_seq,
then ``(identity, b"", -1 as 8 signed bytes, b"")``. A subscriber that sees a gap in seq asks
for the missing batches there.

Block hashes (64-bit unsigned ints): vLLM's ``sha256_cbor_64bit`` chain, which external indexers
recompute from a prompt's tokens to look a prefix up: block i's hash is the low 64 bits of
SHA-256 over the canonical CBOR encoding of ``[parent, token_ids, None]`` (parent: the hash of
block i-1, or for block 0 the root hash: the low 64 bits of SHA-256 over the CBOR text string of
the hash seed, vLLM's PYTHONHASHSEED; here ``hash_seed``, default "0"). The scheduler's own
prefix-cache keys (scheduler_svc.prefix_cache) are Python hashes, cheaper and process-stable but
not reproducible outside Python; the external hash is computed only when events are on, once per
block, and remembered per internal key while the block stays cached.

Events are recorded synchronously by the block manager's hooks (scheduler thread) and published
by the publisher's thread every `flush_interval_s`: one batch holds the events of one or more
iterations, in order.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import msgpack

log = logging.getLogger("sarathi.kv_events")

MEDIUM_GPU = "GPU"   # vLLM's medium name for the device KV cache (also used for a CPU worker's)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
U64 = (1 << 64) - 1


# -- block hashing (vLLM's sha256_cbor_64bit) ----------------------------------------------------
def _cbor_head(major: int, n: int) -> bytes:
    """Canonical (shortest-form) CBOR head of major type `major` with argument n >= 0."""
    if n < 24:
        return bytes([(major << 5) | n])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([(major << 5) | extra]) + n.to_bytes(size, "big")
    raise ValueError(f"{n} does not fit in 64 bits")


_TOKEN_CBOR: dict[int, bytes] = {}   # token id -> its CBOR (hashing runs per block, on the scheduler thread)


def _token_cbor(t: int) -> bytes:
    b = _TOKEN_CBOR.get(t)
    if b is None:
        b = _TOKEN_CBOR[t] = _cbor_head(0, int(t))
    return b


def cbor_block_key(parent: int, token_ids) -> bytes:
    """Canonical CBOR of [parent, [token ids], None] (ints >= 0), as cbor2.dumps(...,
    canonical=True) writes it."""
    return b"".join((b"\x83", _cbor_head(0, parent), _cbor_head(4, len(token_ids)),
                     *map(_token_cbor, token_ids), b"\xf6"))


def _low64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[-8:], "big")


def root_hash(seed: str = "0") -> int:
    """The parent hash of a request's first block: low 64 bits of SHA-256(CBOR text `seed`)."""
    raw = seed.encode()
    return _low64(_cbor_head(3, len(raw)) + raw)


def block_hash(parent: int, token_ids) -> int:
    """The hash of a full block of `token_ids` after the prefix whose hash is `parent`."""
    return _low64(cbor_block_key(parent, token_ids))


def prefix_hashes(token_ids, block_size: int, seed: str = "0") -> list[int]:
    """Hashes of every full block of a token sequence (what an indexer computes for a prompt)."""
    out, parent = [], root_hash(seed)
    for i in range(len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


# -- the events ---------------------------------------------------------------------------------
@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None

    def to_wire(self) -> list:
        return ["BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids,
                self.block_size, self.lora_id, self.medium, self.lora_name]


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU

    def to_wire(self) -> list:
        return ["BlockRemoved", self.block_hashes, self.medium]


@dataclass
class AllBlocksCleared:
    def to_wire(self) -> list:
        return ["AllBlocksCleared"]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_batch(ts: float, events: list[KVEvent], data_parallel_rank: int | None = 0) -> bytes:
    """One KVEventBatch as msgpack: [ts, [event arrays], data_parallel_rank] (the rank left out
    when None, as msgspec's omit_defaults does)."""
    body = [float(ts), [e.to_wire() for e in events]]
    if data_parallel_rank is not None:
        body.append(data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent], int | None]:
    """The inverse of encode_batch, checking each event against its schema (ValueError if not)."""
    body = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    if not isinstance(body, list) or len(body) not in (2, 3) or not isinstance(body[0], float):
        raise ValueError(f"not a KVEventBatch: {body!r:.200}")
    events = []
    for e in body[1]:
        tag = e[0] if isinstance(e, list) and e else None
        if tag == "BlockStored" and len(e) >= 6:
            hashes, parent, tokens, size = e[1], e[2], e[3], e[4]
            if not (all(isinstance(h, int) and 0 <= h <= U64 for h in hashes)
                    and (parent is None or isinstance(parent, int))
                    and all(isinstance(t, int) for t in tokens) and isinstance(size, int)
                    and len(tokens) == len(hashes) * size):
                raise ValueError(f"malformed BlockStored: {e!r:.200}")
            events.append(BlockStored(hashes, parent, tokens, size, *e[5:8]))
        elif tag == "BlockRemoved" and len(e) >= 2:
            if not all(isinstance(h, int) and 0 <= h <= U64 for h in e[1]):
                raise ValueError(f"malformed BlockRemoved: {e!r:.200}")
            events.append(BlockRemoved(e[1], *e[2:3]))
        elif tag == "AllBlocksCleared":
            events.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown KV event: {e!r:.200}")
    return body[0], events, body[2] if len(body) == 3 else None


# -- recording: the block manager's hooks -------------------------------------------------------
class KVEventRecorder:
    """Turns the block manager's cache changes into events (BlockManager.events = recorder).

    Hooks (called by scheduler_svc.block_manager on the scheduler thread):
    stored(req, indices): req's blocks at these indices were just keyed (computed, findable);
    removed(key): the cached block with this internal key is being overwritten;
    cleared(): every cached block is forgotten.
    Invariant: a BlockRemoved names only hashes announced by a BlockStored since the last
    AllBlocksCleared, each once.
    """

    def __init__(self, block_size: int, hash_seed: str = "0", sink: Callable[[KVEvent], None] | None = None):
        self.block_size = block_size
        self.hash_seed = hash_seed
        self._root = root_hash(hash_seed)
        self._ext: dict[int, int] = {}        # internal key of a cached block -> external hash
        self._lock = threading.Lock()
        self._pending: list[KVEvent] = []
        self.sink = sink                      # also called with every event (in-process indexers)

    def _emit(self, ev: KVEvent) -> None:
        with self._lock:
            self._pending.append(ev)
        if self.sink is not None:
            self.sink(ev)

    def drain(self) -> list[KVEvent]:
        """The events recorded since the last drain, in order."""
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def _external(self, req, first: int, upto: int) -> dict[int, int]:
        """External hashes of req's blocks first-1 .. upto-1 (index -> hash; cached blocks'
        remembered, the others computed along the chain from the nearest remembered one)."""
        bs, keys = self.block_size, req.block_hashes
        start = first - 1
        while start >= 0 and keys[start] not in self._ext:
            start -= 1
        parent = self._root if start < 0 else self._ext[keys[start]]
        out = {start: parent} if start >= 0 else {}
        for i in range(start + 1, upto):
            h = self._ext.get(keys[i])
            if h is None:
                h = block_hash(parent, req.token_ids[i * bs:(i + 1) * bs])
            out[i] = parent = h
        return out

    def stored(self, req, indices: list[int]) -> None:
        if not indices:
            return
        ext = self._external(req, indices[0], indices[-1] + 1)
        run: list[int] = []
        for i in indices:              # one BlockStored per run of consecutive blocks
            if run and i != run[-1] + 1:
                self._stored_run(req, run, ext)
                run = []
            run.append(i)
        self._stored_run(req, run, ext)
        for i in indices:
            self._ext[req.block_hashes[i]] = ext[i]

    def _stored_run(self, req, run: list[int], ext: dict[int, int]) -> None:
        bs, first = self.block_size, run[0]
        self._emit(BlockStored([ext[i] for i in run], ext[first - 1] if first > 0 else None,
                               [int(t) for t in req.token_ids[first * bs:(run[-1] + 1) * bs]], bs))

    def removed(self, key: int) -> None:
        h = self._ext.pop(key, None)
        if h is not None:
            self._emit(BlockRemoved([h]))

    def cleared(self) -> None:
        self._ext.clear()
        self._emit(AllBlocksCleared())


# -- publishing -----------------------------------------------------------------------------------
SocketHook = Callable[[object, str], None]


class ZmqEventPublisher:
    """PUB (+ replay ROUTER) publisher of a recorder's events, on its own thread.

    endpoint: the PUB address; bound (default loopback) unless connect=True (a central
    subscriber that binds, as llm-d's indexer does). replay_endpoint: the ROUTER address (bound),
    None: no replay. buffer_steps: batches kept for replay. topic: the first frame of every
    message (llm-d reads the pod and model from ``kv@<pod>@<model>``). socket_hook(socket, role):
    called on each socket before it binds or connects (role "pub" or "replay"): where transport
    security (e.g. CURVE keys) is set. flush_interval_s: how often pending events go out (s).
    """

    def __init__(self, recorder: KVEventRecorder, endpoint: str = "tcp://127.0.0.1:5557", *,
                 replay_endpoint: str | None = "tcp://127.0.0.1:5558", connect: bool = False,
                 topic: str = "", buffer_steps: int = 10_000, hwm: int = 100_000,
                 data_parallel_rank: int = 0, flush_interval_s: float = 0.01,
                 socket_hook: SocketHook | None = None):
        import zmq

        self.recorder = recorder
        self.topic = topic.encode()
        self.dp_rank = data_parallel_rank
        self.flush_interval_s = flush_interval_s
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if socket_hook is not None:
            socket_hook(self._pub, "pub")
        if connect:
            self._pub.connect(endpoint)
        else:
            self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            if socket_hook is not None:
                socket_hook(self._replay, "replay")
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @property
    def next_seq(self) -> int:
        return self._seq

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(self.flush_interval_s * 1000)) if self._replay is not None else {}
                if self._replay is None:
                    time.sleep(self.flush_interval_s)
                self._flush()
                if self._replay is not None and ready.get(self._replay):
                    self._serve_replay()
            except Exception:  # noqa: BLE001 - the scheduler must not die for its event stream
                log.exception("KV event publishing failed")
                time.sleep(0.1)
        self._flush()

    def _flush(self) -> None:
        events = self.recorder.drain()
        if not events:
            return
        payload = encode_batch(time.time(), events, self.dp_rank)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid KV event replay request (%d frames)", len(frames))
            return
        ident, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((ident, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((ident, b"", END_SEQ, b""))

    def close(self) -> None:
        """Publish what is pending, stop the thread, close the sockets."""
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)


def start_publisher(config_json: str, block_manager, *, socket_hook: SocketHook | None = None) -> ZmqEventPublisher:
    """Attach a recorder to `block_manager` and start publishing its events, configured by the
    JSON of SchedulerConfig.kv_events_config (keys: endpoint, replay_endpoint (null: none),
    topic, hash_seed, connect, buffer_steps, data_parallel_rank). Needs prefix caching: without
    it no block is ever findable, so there is nothing to announce (ValueError)."""
    import json

    if block_manager.cache is None:
        raise ValueError("KV-cache events need prefix caching (--prefix-caching)")
    cfg = json.loads(config_json) if config_json.strip() else {}
    known = {"endpoint", "replay_endpoint", "topic", "hash_seed", "connect", "buffer_steps",
             "data_parallel_rank"}
    if not isinstance(cfg, dict) or set(cfg) - known:
        raise ValueError(f"--kv-events-config: a JSON object with keys among {sorted(known)}, got {config_json!r}")
    # the events carry prompts' token ids: a socket listening beyond loopback would hand every
    # user's prompts to whoever connects; subscribers (the endpoint picker) cannot do CURVE, so
    # such a bind needs the operator's explicit opt-in, as an unkeyed link does (shared.link_auth)
    from shared.link_auth import check_bind

    endpoint = cfg.get("endpoint", "tcp://127.0.0.1:5557")
    if not cfg.get("connect", False):
        check_bind(endpoint, None, "the KV-cache event publisher")
    if cfg.get("replay_endpoint", "tcp://127.0.0.1:5558"):
        check_bind(cfg.get("replay_endpoint", "tcp://127.0.0.1:5558"), None, "the KV-cache event replay socket")
    rec = KVEventRecorder(block_manager.block_size, str(cfg.get("hash_seed", "0")))
    pub = ZmqEventPublisher(rec, endpoint,
                            replay_endpoint=cfg.get("replay_endpoint", "tcp://127.0.0.1:5558"),
                            connect=bool(cfg.get("connect", False)), topic=cfg.get("topic", ""),
                            buffer_steps=int(cfg.get("buffer_steps", 10_000)),
                            data_parallel_rank=int(cfg.get("data_parallel_rank", 0)), socket_hook=socket_hook)
    block_manager.events = rec
    log.info("KV-cache events on %s (replay %s, topic %r)", pub.endpoint, pub.replay_endpoint, cfg.get("topic", ""))
    return pub

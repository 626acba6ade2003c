"""A small endpoint picker in front of real replicas, for benchmarks: the inference gateway's
scorers (sarathi.measure.routing.Scorer, the same code the simulator routes with) over live
state, and an OpenAI-compatible proxy.

For every POST /v1/completions or /v1/chat/completions it
* turns the request's prompt into token ids the way the replica's gateway does (token-id
  prompts as they are; text through the model's tokenizer; chat messages through its chat
  template), and their full blocks into the KV-event block hashes (vLLM's sha256_cbor_64bit
  chain, seeded as the replicas' --kv-events-config hash_seed);
* scores every replica (the picker's routings) on the state it last saw: vllm:num_requests_waiting and
  vllm:kv_cache_usage_perc scraped from each replica's /metrics every `poll_s` seconds (what the
  picker's metrics refresh does), and the replica's prefix cache as its KV-cache events
  announced it (a ZeroMQ SUB socket per replica, vLLM's msgpack batches; a gap in the sequence
  numbers, or joining late, is filled from the replica's replay socket);
* or, for kv-cost (Dynamo's KV router) and cache-aware (SGLang's router), on its own bookkeeping
  as those routers keep it: requests in flight per replica (until their answer ends), their
  uncached prompt tokens (until the answer's first bytes), their prompts' KV blocks;
* forwards the request body unchanged to the chosen replica and passes the answer through byte
  for byte (streamed SSE stays streamed); the response names the replica in `x-routed-to`.

GET /v1/models answers from the first replica; GET /health is open; GET /stats (JSON) counts
the picks per replica and the prefix scorer's matched / looked-up blocks.

Auth (the gateway's story, docs/security.md): the listening socket binds loopback by default;
with --api-key (or --api-key-file) every route but /health needs `Authorization: Bearer <key>`;
a non-loopback --host without a key is refused (gateway.server.check_exposure). The key a
replica wants, if any, is --backend-api-key: the router sends it, never the client's.

    python -m bench.picker_router --routing mix --port 8100 \\
        --replica http://127.0.0.1:8001,tcp://127.0.0.1:5601,tcp://127.0.0.1:5602 \\
        --replica http://127.0.0.1:8002,tcp://127.0.0.1:5611,tcp://127.0.0.1:5612
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import threading
from dataclasses import dataclass

import httpx

from sarathi.measure.routing import OWN_RULE, WEIGHTS, Scorer
from sarathi.measure.scrape import summed
from scheduler_svc.kv_events import END_SEQ, decode_batch
from shared.config import cdiv

log = logging.getLogger("sarathi.picker_router")


@dataclass
class Backend:
    """One replica: its OpenAI base URL, its KV-event PUB endpoint and replay endpoint (None:
    no replay; both None: no events, prefix scoring sees nothing there)."""

    url: str
    events: str | None = None
    replay: str | None = None

    @classmethod
    def parse(cls, spec: str) -> "Backend":
        """URL[,EVENTS[,REPLAY]]."""
        parts = [p.strip() or None for p in spec.split(",")]
        if not parts[0] or len(parts) > 3:
            raise ValueError(f"--replica URL[,EVENTS[,REPLAY]], got {spec!r}")
        return cls(parts[0].rstrip("/"), *parts[1:])


class EventSubscriber:
    """Follows every backend's KV-cache events into scorer.index (thread 'kv-events-sub').

    On start, and whenever the sequence numbers of a backend skip (a late join, a dropped
    message), the batches from the first missing one on come from the replay socket (a DEALER:
    (b"", start) out, (b"", seq, payload) ... (b"", -1, b"") back); batches already applied are
    skipped. A batch with seq 0 after others: the replica's publisher started over (its index
    is emptied)."""

    def __init__(self, backends: list[Backend], scorer: Scorer, replay_timeout_s: float = 2.0):
        import zmq

        self.scorer, self.backends = scorer, backends
        self.replay_timeout_s = replay_timeout_s
        self.next_seq: list[int] = [0] * len(backends)
        self.batches = [0] * len(backends)     # applied batches per backend
        self.replays = 0
        self._ctx = zmq.Context.instance()
        self._subs = {}
        for i, b in enumerate(backends):
            if b.events is None:
                continue
            s = self._ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(b.events)
            self._subs[s] = i
        self._sinks = [scorer.index.sink(i) for i in range(len(backends))] if scorer.index is not None else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-sub", daemon=True)
        self._thread.start()

    def _apply(self, i: int, seq: int, payload: bytes) -> None:
        if seq == 0 and self.next_seq[i] > 0:     # the replica's publisher started over
            self.next_seq[i] = 0
            if self._sinks is not None:
                self.scorer.index.blocks[i].clear()
        if seq < self.next_seq[i]:
            return                      # already applied (a replay overlapping the live stream)
        if seq > self.next_seq[i]:
            self._replay(i, self.next_seq[i])
            if seq < self.next_seq[i]:
                return
        _, events, _ = decode_batch(payload)
        if self._sinks is not None:
            sink = self._sinks[i]
            for ev in events:
                sink(ev)
        self.next_seq[i] = seq + 1
        self.batches[i] += 1

    def _replay(self, i: int, start: int) -> None:
        import zmq

        addr = self.backends[i].replay
        if addr is None:
            log.warning("replica %d: KV events %d.. lost and no replay socket", i, start)
            self.next_seq[i] = start    # what follows is applied; the index may miss blocks
            return
        self.replays += 1
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        try:
            s.send_multipart((b"", start.to_bytes(8, "big")))
            while s.poll(int(self.replay_timeout_s * 1000)):
                frames = s.recv_multipart()
                if len(frames) != 3 or frames[1] == END_SEQ:
                    return
                seq = int.from_bytes(frames[1], "big")
                if seq >= self.next_seq[i]:
                    self.next_seq[i] = seq      # in order: apply it
                    self._apply(i, seq, frames[2])
            log.warning("replica %d: KV event replay from %d timed out", i, start)
        finally:
            s.close(0)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        for s in self._subs:
            poller.register(s, zmq.POLLIN)
        for i in self._subs.values():   # joining: what the replica announced before, from its replay buffer
            if self.backends[i].replay is not None:
                self._replay(i, 0)
        while not self._stop.is_set():
            for s, _ in poller.poll(100):
                i = self._subs[s]
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK)
                    if len(frames) != 3:
                        raise ValueError(f"{len(frames)} frames")
                    self._apply(i, int.from_bytes(frames[1], "big"), frames[2])
                except zmq.Again:
                    continue
                except ValueError as e:   # a malformed batch: dropped, the stream goes on
                    log.warning("replica %d: bad KV event message: %s", i, e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        for s in self._subs:
            s.close(0)


def parse_load(text: str) -> tuple[float, float]:
    """(vllm:num_requests_waiting, vllm:kv_cache_usage_perc) from a Prometheus text page (summed
    over label sets; 0 where absent)."""
    s = summed(text, "vllm:")
    return s.get("vllm:num_requests_waiting", 0.0), s.get("vllm:kv_cache_usage_perc", 0.0)


class Router:
    """The picker's state and the proxy (create_app wraps it)."""

    def __init__(self, backends: list[Backend], routing: str, *, block_size: int = 16, hash_seed: str = "0",
                 tokenizer=None, poll_s: float = 0.05, backend_api_key: str | None = None, seed: int = 0,
                 **rule):
        """rule: the kv-cost / cache-aware settings of Scorer (overlap_weight, balance_abs,
        balance_rel, cache_threshold)."""
        self.backends = backends
        self.scorer = Scorer(routing, len(backends), block_size, seed=seed, hash_seed=hash_seed, **rule)
        self.tokenizer = tokenizer
        self.poll_s = poll_s
        self.waiting = [0.0] * len(backends)
        self.kv_usage = [0.0] * len(backends)
        self.picks = [0] * len(backends)
        # the router's own bookkeeping (kv-cost, cache-aware): requests in flight per replica,
        # their uncached prompt tokens not yet past the first bytes back, their prompts' blocks
        self.in_flight = [0] * len(backends)
        self.prefill = [0] * len(backends)
        self.active_blocks = [0] * len(backends)
        self.scrape_errors = 0
        self._headers = {"Authorization": f"Bearer {backend_api_key}"} if backend_api_key else {}
        self.events = EventSubscriber(backends, self.scorer) if self.scorer.index is not None else None
        self.client: httpx.AsyncClient | None = None
        self._poller: asyncio.Task | None = None

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.client = httpx.AsyncClient(timeout=None, limits=limits, headers=self._headers)
        await self.scrape()
        self._poller = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self.client is not None:
            await self.client.aclose()
        if self.events is not None:
            self.events.close()

    async def scrape(self) -> None:
        async def one(i: int, b: Backend) -> None:
            try:
                r = await self.client.get(f"{b.url}/metrics", timeout=max(1.0, 10 * self.poll_s))
                r.raise_for_status()
                self.waiting[i], self.kv_usage[i] = parse_load(r.text)
            except (httpx.HTTPError, ValueError, IndexError):
                self.scrape_errors += 1     # keep the last state seen
        await asyncio.gather(*(one(i, b) for i, b in enumerate(self.backends)))

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.scrape()

    def prompt_ids(self, path: str, body: dict) -> list[int]:
        """The prompt's token ids, as the replica's gateway computes them (the first prompt of a
        batch); [] when they cannot be known (no tokenizer for a text prompt)."""
        if path.endswith("/chat/completions"):
            msgs = body.get("messages") or []
            if self.tokenizer is None:
                return []
            if hasattr(self.tokenizer, "encode_chat"):
                return self.tokenizer.encode_chat(msgs, tools=body.get("tools"))
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(msgs, tools=body.get("tools")))
        p = body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], (list, str)):
            p = p[0]
        if isinstance(p, list) and all(isinstance(t, int) for t in p):
            return p
        if isinstance(p, str) and self.tokenizer is not None:
            return self.tokenizer.encode(p)
        return []

    def pick(self, ids: list[int]) -> int:
        """The replica for a prompt; the router's own count of what it sent there grows (see
        sent / done)."""
        s = self.scorer
        if s.routing == "cache-aware":         # load: requests in flight, the router's own count
            i = s.choose(ids, self.in_flight)
        elif s.routing == "kv-cost":           # Dynamo's cost on the router's own bookkeeping
            i = s.choose(ids, pending_prefill=self.prefill, active_blocks=self.active_blocks)
        else:
            i = s.choose(ids, self.waiting, self.kv_usage)
        self.picks[i] += 1
        return i

    def sent(self, i: int, ids: list[int]) -> tuple[int, int]:
        """The request just picked (pick) went to replica i: it is in flight there, its uncached prompt tokens are
        pending prefill until its first bytes come back (first_bytes), and its prompt's blocks are
        held until it ends (done). Returns what first_bytes and done give back. (Dynamo also
        counts the blocks a request's output adds; this proxy does not parse the output.)"""
        new = self.scorer.new_prefill_tokens(ids) if self.scorer.index is not None else 0
        blocks = cdiv(len(ids), self.scorer.block_size)
        self.in_flight[i] += 1
        self.prefill[i] += new
        self.active_blocks[i] += blocks
        return new, blocks

    def first_bytes(self, i: int, new: int) -> None:
        self.prefill[i] -= new

    def done(self, i: int, blocks: int) -> None:
        self.in_flight[i] -= 1
        self.active_blocks[i] -= blocks

    def stats(self) -> dict:
        s = self.scorer
        return {"picks": self.picks, "waiting": self.waiting, "kv_usage": self.kv_usage, "in_flight": self.in_flight,
                "pending_prefill_tokens": self.prefill, "active_blocks": self.active_blocks,
                "matched_blocks": s.matched_blocks, "prompt_blocks": s.prompt_blocks,
                "event_batches": self.events.batches if self.events else None,
                "event_replays": self.events.replays if self.events else None,
                "scrape_errors": self.scrape_errors}


def create_app(router: Router, api_key: str | None = None):
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    expected = f"Bearer {api_key}".encode() if api_key else None

    def refused(request: Request) -> Response | None:
        if expected is None or hmac.compare_digest(request.headers.get("authorization", "").encode(), expected):
            return None
        return JSONResponse({"error": {"message": "invalid or missing API key", "type": "invalid_request_error",
                                       "code": "invalid_api_key"}}, 401, headers={"WWW-Authenticate": "Bearer"})

    async def generate(request: Request) -> Response:
        if (r := refused(request)) is not None:
            return r
        raw = await request.body()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError as e:
            return JSONResponse({"error": {"message": f"invalid JSON body: {e}", "type": "invalid_request_error"}}, 400)
        ids = await asyncio.to_thread(router.prompt_ids, request.url.path, body)
        i = router.pick(ids)
        new, blocks = router.sent(i, ids)
        upstream = router.client.build_request("POST", router.backends[i].url + request.url.path, content=raw,
                                               headers={"content-type": "application/json"})
        try:
            resp = await router.client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            router.first_bytes(i, new)
            router.done(i, blocks)
            return JSONResponse({"error": {"message": f"replica {i} unreachable: {type(e).__name__}",
                                           "type": "server_error"}}, 502, headers={"x-routed-to": str(i)})
        keep = {k: v for k, v in resp.headers.items() if k.lower() in ("content-type", "cache-control", "retry-after")}
        keep["x-routed-to"] = str(i)

        async def body_then_account():
            first = True
            try:
                async for chunk in resp.aiter_raw():
                    if first:
                        router.first_bytes(i, new)
                        first = False
                    yield chunk
            finally:
                if first:
                    router.first_bytes(i, new)
                router.done(i, blocks)

        return StreamingResponse(body_then_account(), status_code=resp.status_code, headers=keep,
                                 background=BackgroundTask(resp.aclose))

    async def models(request: Request) -> Response:
        if (r := refused(request)) is not None:
            return r
        resp = await router.client.get(router.backends[0].url + "/v1/models")
        return Response(resp.content, resp.status_code, media_type="application/json")

    async def stats(request: Request) -> Response:
        if (r := refused(request)) is not None:
            return r
        return JSONResponse(router.stats())

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await router.start()
        yield
        await router.stop()

    return Starlette(routes=[Route("/v1/completions", generate, methods=["POST"]),
                             Route("/v1/chat/completions", generate, methods=["POST"]),
                             Route("/v1/models", models), Route("/stats", stats), Route("/health", health)],
                     lifespan=lifespan)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from gateway.server import check_exposure, read_api_key

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replica", action="append", required=True, help="URL[,EVENTS[,REPLAY]] (repeat)")
    p.add_argument("--routing", default="mix", choices=sorted([*WEIGHTS, *OWN_RULE]))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--api-key", default=None)
    p.add_argument("--api-key-file", default=None)
    p.add_argument("--backend-api-key", default=None, help="the replicas' API key, if they want one")
    p.add_argument("--model", default=None, help="whose tokenizer and chat template to use (default: SmolLM2)")
    p.add_argument("--block-size", type=int, default=16, help="the replicas' --block-size")
    p.add_argument("--hash-seed", default="0", help="the replicas' KV-event hash_seed")
    p.add_argument("--poll", type=float, default=0.05, help="seconds between metric scrapes")
    p.add_argument("--seed", type=int, default=0, help="tie-breaking")
    p.add_argument("--kv-overlap-weight", type=float, default=None,
                   help="kv-cost: a prefill block's cost in KV blocks held (Dynamo's --kv-overlap-score-weight; 1)")
    p.add_argument("--balance-abs-threshold", type=float, default=None,
                   help="cache-aware: requests in flight one replica has over another before the least loaded "
                        "takes the request (SGLang's router; 64)")
    p.add_argument("--balance-rel-threshold", type=float, default=None,
                   help="cache-aware: ... and this many times as many (1.5)")
    p.add_argument("--cache-threshold", type=float, default=None,
                   help="cache-aware: the matched fraction of the prompt above which the longest match wins (0.3)")
    p.add_argument("--log-level", default="warning")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    key = read_api_key(a.api_key, a.api_key_file)
    check_exposure(a.host, bool(key))
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer

    router = Router([Backend.parse(s) for s in a.replica], a.routing, block_size=a.block_size,
                    hash_seed=a.hash_seed, tokenizer=load_tokenizer(resolve_model(a.model)), poll_s=a.poll,
                    backend_api_key=a.backend_api_key, seed=a.seed, overlap_weight=a.kv_overlap_weight,
                    balance_abs=a.balance_abs_threshold, balance_rel=a.balance_rel_threshold,
                    cache_threshold=a.cache_threshold)
    uvicorn.run(create_app(router, key), host=a.host, port=a.port, log_level=a.log_level)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The queue on Redis streams (distributed mode): key layout, helpers, the gateway side.
The scheduler side is in shared.queue.redis_scheduler.

Keys (all under QueueConfig.prefix):
* `requests`: stream of RequestMsg (field "req", JSON), read by the consumer group `group`.
  An entry stays in the group's pending-entries list (PEL) until the scheduler acks it, and is
  deleted on ack: so XLEN - (PEL size) is the number of requests not yet taken (`depth`).
* `aborts`: stream of aborted ids (field "req_id"); every scheduler reads all of it (XREAD,
  no group), MAXLEN-trimmed.
* `out:<gateway id>`: one stream per gateway; each entry is one publish call's events for that
  gateway (field "events", a JSON list), MAXLEN-trimmed, expiring out_ttl_s after the last
  publish so a dead gateway's stream does not leak.
* `schedulers` (a set of consumer names) and `scheduler:<consumer>` (a key with a TTL): the
  heartbeat the gateway's /ready reads.
* `epochs`: a hash req_id -> the epoch of the request's current owner (the fence; the scheduler
  side sets it when it takes a request, deletes it on ack).
* `gateway:<gateway id>` (a key with a TTL): the gateway's lease.

Credentials: the URL's (`redis://user:password@host:port/db`; `rediss://` for TLS), else those
client_options finds in the environment, so that a password never has to be on a command line.
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import AsyncIterator
from urllib.parse import urlparse

import redis
import redis.asyncio as aioredis

from shared.messages import RequestMsg, TokenEvent
from shared.queue.base import GatewayQueue, QueueConfig, QueueFullError, QueueResetError
from shared.queue.common import decode_events, encode_request

PAGE = 256  # entries per Redis round trip when draining a backlog

# Connections outlive a Redis restart in the pool: ping one idle this long before using it
# (a dead one is replaced instead of failing the command), and retry a command that loses its
# connection a few times with a short backoff (seconds).
HEALTH_CHECK_INTERVAL_S = 1


def client_options(asyncio: bool, url: str | None = None) -> dict:
    """Keyword arguments for redis.Redis.from_url / redis.asyncio.Redis.from_url(url), with the
    credentials of auth_options(url)."""
    from redis.backoff import ExponentialBackoff
    if asyncio:
        from redis.asyncio.retry import Retry
    else:
        from redis.retry import Retry

    class _Retry(Retry):
        """Retries a lost connection, not a refused password (redis-py counts an
        AuthenticationError as a ConnectionError): that one fails at once."""

        def call_with_retry(self, do, fail, is_retryable=None, **kw):
            def retryable(error) -> bool:
                return (not isinstance(error, redis.AuthenticationError)
                        and (is_retryable is None or is_retryable(error)))
            return super().call_with_retry(do, fail, retryable, **kw)

    return dict(decode_responses=True, health_check_interval=HEALTH_CHECK_INTERVAL_S,
                retry=_Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
                retry_on_error=[redis.ConnectionError, redis.TimeoutError],
                **(auth_options(url) if url else {}))


def auth_options(url: str, env: dict | None = None) -> dict:
    """Password and TLS keyword arguments for a connection to `url`, from the environment:

    * SARATHI_REDIS_PASSWORD_FILE: a file holding the password (a mounted Kubernetes Secret;
      surrounding whitespace is ignored), else SARATHI_REDIS_PASSWORD; SARATHI_REDIS_USERNAME
      for an ACL user. A password in the URL wins over both.
    * only for `rediss://` URLs (TLS): SARATHI_REDIS_TLS_CA_FILE, the CA that signed the
      server's certificate (default: the system's CAs), and SARATHI_REDIS_TLS_CERT_FILE /
      SARATHI_REDIS_TLS_KEY_FILE, a client certificate for servers that ask for one. The server's
      certificate is always verified, its host name included.
    A password file that is named but unreadable raises (FileNotFoundError, PermissionError):
    starting without the password would only fail later, less clearly."""
    env = os.environ if env is None else env
    parsed = urlparse(url)
    out: dict = {}
    if not parsed.password:
        path = env.get("SARATHI_REDIS_PASSWORD_FILE")
        if path:
            with open(path, encoding="utf-8") as f:
                out["password"] = f.read().strip()
        elif env.get("SARATHI_REDIS_PASSWORD"):
            out["password"] = env["SARATHI_REDIS_PASSWORD"]
        if env.get("SARATHI_REDIS_USERNAME") and not parsed.username:
            out["username"] = env["SARATHI_REDIS_USERNAME"]
    if parsed.scheme == "rediss":
        out["ssl_cert_reqs"] = "required"
        out["ssl_check_hostname"] = True
        for key, var in (("ssl_ca_certs", "SARATHI_REDIS_TLS_CA_FILE"),
                         ("ssl_certfile", "SARATHI_REDIS_TLS_CERT_FILE"),
                         ("ssl_keyfile", "SARATHI_REDIS_TLS_KEY_FILE")):
            if env.get(var):
                out[key] = env[var]
    return out


# submit: refuse beyond the bound instead of growing the stream; renew the gateway's lease.
# KEYS: requests stream, gateway lease key. ARGV: requests_maxlen, request JSON, lease ms.
_SUBMIT = """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return false end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[3])
return redis.call('XADD', KEYS[1], '*', 'req', ARGV[2])
"""

FENCE_MEMORY = 65_536  # requests whose highest epoch a gateway remembers (oldest forgotten first)


def is_busygroup(exc: redis.ResponseError) -> bool:
    return str(exc).startswith("BUSYGROUP")


def entries_of(resp) -> list[tuple[str, dict]]:
    """The (id, fields) entries of an XREAD/XREADGROUP reply (RESP2: [[stream, entries]])."""
    return [e for _, entries in resp or [] for e in entries]


class RedisGatewayQueue(GatewayQueue):
    """One gateway's view of the queue. Use it from one asyncio loop."""

    def __init__(self, url: str, config: QueueConfig, gateway_id: str):
        self.r = aioredis.Redis.from_url(url, **client_options(asyncio=True, url=url))
        self.cfg, self.gateway_id = config, gateway_id
        self._group_ready = False
        self._cursor = "0-0"  # id of the last reply entry read: the stream is ours alone
        self._run_id: str | None = None  # the Redis instance we talk to (INFO server run_id)
        self._submit = self.r.register_script(_SUBMIT)
        self._epochs: OrderedDict[str, int] = OrderedDict()  # req_id -> highest epoch seen
        self.fenced = 0  # events dropped by the fence (a former owner's)

    async def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            await self.r.xgroup_create(self.cfg.requests_key, self.cfg.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if not is_busygroup(exc):
                raise
        self._group_ready = True

    async def submit(self, req: RequestMsg) -> None:
        await self._ensure_group()
        added = await self._submit(keys=[self.cfg.requests_key, self.cfg.gateway_key(self.gateway_id)],
                                   args=[self.cfg.requests_maxlen, encode_request(req),
                                         int(self.cfg.gateway_ttl_s * 1000)])
        if added is None:
            raise QueueFullError(f"the request queue is full ({self.cfg.requests_maxlen} entries)")

    def _admit_event(self, ev: TokenEvent) -> bool:
        """The gateway side of the fence (see GatewayQueue.events)."""
        if not ev.epoch:
            return True
        seen = self._epochs.get(ev.req_id, 0)
        if ev.epoch < seen:
            self.fenced += 1
            return False
        self._epochs[ev.req_id] = ev.epoch
        self._epochs.move_to_end(ev.req_id)
        while len(self._epochs) > FENCE_MEMORY:
            self._epochs.popitem(last=False)
        return True

    async def _renew_lease(self) -> None:
        await self.r.set(self.cfg.gateway_key(self.gateway_id), "1", px=int(self.cfg.gateway_ttl_s * 1000))

    async def abort(self, req_id: str) -> None:
        await self.r.xadd(self.cfg.aborts_key, {"req_id": req_id},
                          maxlen=self.cfg.aborts_maxlen, approximate=True)

    async def _check_instance(self) -> None:
        """Raise QueueResetError once when Redis is a new instance (restarted): what it held
        may be gone, so the reply cursor starts over and the group is created again."""
        run_id = (await self.r.info("server"))["run_id"]
        old, self._run_id = self._run_id, run_id
        if old is not None and old != run_id:
            self._cursor, self._group_ready = "0-0", False
            self._epochs.clear()  # the epochs were in the old instance: they start over
            raise QueueResetError(f"Redis restarted (run_id {old[:8]} -> {run_id[:8]})")

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Resumes after the last entry read by any earlier call (e.g. after a Redis error).
        Checks about once a second that Redis is the same instance (QueueResetError if not)."""
        key = self.cfg.out_key(self.gateway_id)
        await self._check_instance()
        await self._renew_lease()
        renew_every = min(1.0, self.cfg.gateway_ttl_s / 3)  # seconds
        last_trim = last_renew = time.monotonic()
        while True:
            resp = await self.r.xread({key: self._cursor}, count=PAGE, block=max(1, int(renew_every * 1000)))
            for eid, fields in entries_of(resp):
                self._cursor = eid
                for ev in decode_events(fields["events"]):
                    if self._admit_event(ev):
                        yield ev
            if time.monotonic() - last_renew > renew_every:
                await self._renew_lease()
                last_renew = time.monotonic()
            if time.monotonic() - last_trim > 1.0:
                await self._check_instance()
                if self._cursor != "0-0":
                    # Entries we have read are of no further use: free them now instead of
                    # waiting for MAXLEN or the TTL.
                    await self.r.xtrim(key, minid=self._cursor, approximate=True)
                last_trim = time.monotonic()

    async def depth(self) -> int:
        await self._ensure_group()
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.xlen(self.cfg.requests_key)
            pipe.xpending(self.cfg.requests_key, self.cfg.group)
            length, pending = await pipe.execute()
        return max(0, length - int(pending["pending"]))

    async def scheduler_alive(self) -> bool:
        names = await self.r.smembers(self.cfg.schedulers_key)
        if not names:
            return False
        return await self.r.exists(*[self.cfg.heartbeat_key(n) for n in names]) > 0

    async def close(self) -> None:
        await self.r.aclose()

"""The request queue between gateways and schedulers, and the token streams back.

Two sides, two implementations with the same semantics:

* `GatewayQueue` (async, used inside the gateway's asyncio loop): submit requests, send aborts,
  receive the TokenEvents addressed to this gateway, read the queue depth for backpressure.
* `SchedulerQueue` (sync, called from the scheduler's loop thread): fetch new requests only when
  there is room (pull-based admission), ack finished/aborted ones, replay un-acked ones after a
  restart, publish token events, poll aborts.

Implementations: `shared.queue.redis_streams` (distributed mode: a Redis stream with a consumer
group; the pending-entries list is the durable in-flight set) and `shared.queue.local` (embedded
mode: one process, no Redis; the gateway's event loop and the scheduler thread share a broker).

Invariants both implementations keep:
* `submit` returns only once the request is durable (Redis: XADD returned).
* `fetch` returns only requests never delivered before; a request stays "pending" for its
  consumer until `ack`, and `replay_pending` hands pending ones back after a restart.
* A request aborted before it was fetched is never returned by fetch/replay (it is acked and
  dropped), so `poll_aborts` may name ids the scheduler never saw: ignore unknown ids.
* Every TokenEvent is delivered to the gateway named by its request's `reply_to`, in publish
  order; duplicates (same req_id and index) can happen after a replay and are the gateway's
  to drop.
* Exactly one runner per request: a request has one owner at a time, and each take (fetch, or
  a claim of a dead or stalled consumer's request) raises its epoch. Events carry their
  publisher's epoch; a former owner's are not sent (the scheduler side) and not delivered once
  a newer epoch was seen (the gateway side). The former owner learns of the loss through
  `take_lost` and stops running the request.
* A gateway holds a lease while it reads its events; a scheduler aborts the requests of a
  gateway whose lease expired (`dead_gateways`) instead of running them to max_tokens.
* The request stream is bounded (QueueConfig.requests_maxlen): submit raises QueueFullError.

Redis connections take their credentials from the URL (`redis://:password@host`, or
`rediss://` for TLS) and from the environment (see shared.queue.redis_streams.client_options):
SARATHI_REDIS_PASSWORD_FILE (a mounted Secret) or SARATHI_REDIS_PASSWORD, SARATHI_REDIS_USERNAME,
SARATHI_REDIS_TLS_CA_FILE, SARATHI_REDIS_TLS_CERT_FILE / SARATHI_REDIS_TLS_KEY_FILE.
"""
from __future__ import annotations

from shared.queue.base import (
    GatewayQueue,
    QueueConfig,
    QueueFullError,
    QueueResetError,
    QueueUnavailableError,
    SchedulerQueue,
    default_consumer_name,
    new_gateway_id,
)

__all__ = ["GatewayQueue", "QueueConfig", "QueueFullError", "QueueResetError", "QueueUnavailableError",
           "SchedulerQueue", "default_consumer_name", "make_gateway_queue", "make_queues",
           "make_scheduler_queue", "new_gateway_id", "redis_auth_options"]


def redis_auth_options(url: str) -> dict:
    """Password and TLS keyword arguments for redis.Redis.from_url(url) from the environment, as
    the queue's own clients use them (shared.queue.redis_streams.auth_options): for any other
    Redis client of the deployment."""
    from shared.queue.redis_streams import auth_options
    return auth_options(url)


def make_gateway_queue(redis_url: str | None, *, config: QueueConfig | None = None,
                       gateway_id: str | None = None, broker=None) -> GatewayQueue:
    """Redis when redis_url is given; else the in-process queue over `broker` (a LocalBroker
    shared with the scheduler side; required in that case)."""
    config = config or QueueConfig()
    gateway_id = gateway_id or new_gateway_id()
    if redis_url:
        from shared.queue.redis_streams import RedisGatewayQueue
        return RedisGatewayQueue(redis_url, config, gateway_id)
    if broker is None:
        raise ValueError("the in-process queue needs the broker shared with the scheduler side")
    from shared.queue.local import LocalGatewayQueue
    return LocalGatewayQueue(broker, gateway_id)


def make_scheduler_queue(redis_url: str | None, *, config: QueueConfig | None = None,
                         consumer: str | None = None, broker=None) -> SchedulerQueue:
    """Redis when redis_url is given; else the in-process queue over `broker` (required)."""
    config = config or QueueConfig()
    consumer = consumer or default_consumer_name()
    if redis_url:
        from shared.queue.redis_scheduler import RedisSchedulerQueue
        return RedisSchedulerQueue(redis_url, config, consumer)
    if broker is None:
        raise ValueError("the in-process queue needs the broker shared with the gateway side")
    from shared.queue.local import LocalSchedulerQueue
    return LocalSchedulerQueue(broker, consumer)


def make_queues(redis_url: str | None, *, config: QueueConfig | None = None,
                gateway_id: str | None = None, consumer: str | None = None
                ) -> tuple[GatewayQueue, SchedulerQueue]:
    """Both sides at once: embedded mode (redis_url None: an in-process broker, no Redis) or a
    single process that still wants Redis."""
    config = config or QueueConfig()
    broker = None
    if not redis_url:
        from shared.queue.local import LocalBroker
        broker = LocalBroker(config)
    return (make_gateway_queue(redis_url, config=config, gateway_id=gateway_id, broker=broker),
            make_scheduler_queue(redis_url, config=config, consumer=consumer, broker=broker))

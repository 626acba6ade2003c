"""Authenticated internal links: ZeroMQ CURVE between the scheduler and its workers, and between
workers (KV blocks), with an allow-list of client keys per socket.

Who holds which key (one key set per deployment, made by `sarathi keys DIR`):

* the workers share one keypair, `worker.key_secret`. Every worker socket that accepts
  connections (the batch socket, the KV receiver) is a CURVE server with it; a worker's KV
  sender is a CURVE client with the same keypair.
* the scheduler has its own keypair, `scheduler.key_secret`, and knows the workers' public key
  (`worker.key`): a client must name the server's key, so a scheduler cannot be tricked into
  talking to an impostor worker.
* a worker accepts on its batch socket only the public keys in `authorized_schedulers`; on its
  KV receiver it accepts those (announcements of transfers) and `authorized_workers` (KV data),
  and tells them apart per message (see kvstore.link). Several keys per list allow a rolling
  rotation (docs/internal-links.md).

Where keys come from (`process_keys(role)`), so that a Kubernetes Secret can be mounted either way:
``SARATHI_LINK_KEYS=DIR`` (the files above), or the keys themselves in
``SARATHI_LINK_SECRET_KEY`` (this process's z85 secret key), ``SARATHI_LINK_SERVER_KEY`` (the
workers' public key; schedulers), ``SARATHI_LINK_SCHEDULER_KEYS`` and ``SARATHI_LINK_WORKER_KEYS``
(comma-separated public keys; workers). Neither: no keys, plain links.

Which links use CURVE: tcp:// ones, when keys are configured. ipc:// and inproc:// never leave
the machine (or the process); an ipc socket is guarded by its file's permissions (`sarathi serve`
puts its sockets in a private temporary directory), so the embedded mode needs no keys. A socket
without keys may bind loopback TCP only: binding another interface without keys is refused
(`LinkSecurityError`) unless ``SARATHI_INSECURE_LINKS=1`` says that the network itself is
trusted, and then a warning is logged.

Every socket of these links is also bounded (`bound`): a largest message (ZMQ_MAXMSGSIZE: a
larger one drops the connection before it is buffered), queue limits and a send timeout, so
neither a stranger nor a stuck peer can make a process buffer without bound.
"""
from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("sarathi.links")

ENV_DIR = "SARATHI_LINK_KEYS"
ENV_SECRET = "SARATHI_LINK_SECRET_KEY"
ENV_SERVER = "SARATHI_LINK_SERVER_KEY"
ENV_SCHEDULERS = "SARATHI_LINK_SCHEDULER_KEYS"
ENV_WORKERS = "SARATHI_LINK_WORKER_KEYS"
ENV_INSECURE = "SARATHI_INSECURE_LINKS"

ROLES = ("scheduler", "worker")
SCHEDULERS_FILE, WORKERS_FILE = "authorized_schedulers", "authorized_workers"


class LinkSecurityError(ValueError):
    """Keys missing, malformed or incomplete, or a plain socket asked to bind a network address."""


@dataclass(frozen=True)
class LinkKeys:
    """The CURVE keys of one process (all z85 text as bytes, 40 characters each).

    role: "scheduler" or "worker". public, secret: this process's keypair. server_public: the
    workers' public key (what every client of a worker socket expects). schedulers: client keys
    allowed to drive a worker and to announce KV transfers (workers only). workers: client keys
    allowed to send KV blocks (workers only)."""

    role: str
    public: bytes
    secret: bytes
    server_public: bytes
    schedulers: frozenset[bytes] = field(default_factory=frozenset)
    workers: frozenset[bytes] = field(default_factory=frozenset)


# ---------------------------------------------------------------------------------------------
# making and loading keys
# ---------------------------------------------------------------------------------------------
def write_key_set(out_dir: str | os.PathLike, force: bool = False) -> list[Path]:
    """Write a deployment's key set into out_dir (created mode 0700): worker.key(_secret),
    scheduler.key(_secret), authorized_schedulers, authorized_workers. Secret files are mode
    0600. Refuses to overwrite an existing key set unless force. Returns the files written."""
    out = Path(out_dir)
    names = ["worker.key", "worker.key_secret", "scheduler.key", "scheduler.key_secret",
             SCHEDULERS_FILE, WORKERS_FILE]
    if not force and any((out / n).exists() for n in names):
        raise LinkSecurityError(f"{out} already holds a key set; pass --force to replace it")
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    for role in ROLES:
        zmq.auth.create_certificates(out, role)
        (out / f"{role}.key_secret").chmod(0o600)
    for role, fname in (("scheduler", SCHEDULERS_FILE), ("worker", WORKERS_FILE)):
        public, _ = zmq.auth.load_certificate(out / f"{role}.key")
        (out / fname).write_text(f"# public keys allowed as {role}s, one per line (z85)\n"
                                 f"{public.decode()}\n")
    return [out / n for n in names]


def _check_key(key: bytes, what: str) -> bytes:
    try:
        zmq.utils.z85.decode(key)
    except Exception as e:  # noqa: BLE001 - any decoding failure means a bad key
        raise LinkSecurityError(f"{what} is not a z85 CURVE key: {e}") from None
    if len(key) != 40:
        raise LinkSecurityError(f"{what} is not a CURVE key: {len(key)} characters, 40 expected")
    return key


def _key_list(text: str, what: str) -> frozenset[bytes]:
    """Public keys from a file's or a variable's text: separated by commas or whitespace; lines
    starting with # are comments."""
    words = " ".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return frozenset(_check_key(w.encode(), what) for w in words.replace(",", " ").split())


def load_keys_dir(role: str, key_dir: str | os.PathLike) -> LinkKeys:
    """A process's keys from a directory written by write_key_set (or a mounted Secret holding
    the files this role needs: a scheduler needs scheduler.key_secret and worker.key; a worker
    worker.key_secret, authorized_schedulers and, optionally, authorized_workers)."""
    d = Path(key_dir)
    if role not in ROLES:
        raise ValueError(f"unknown link role {role!r}")
    secret_file = d / f"{role}.key_secret"
    if not secret_file.is_file():
        raise LinkSecurityError(f"no {secret_file.name} in {d}: make a key set with `sarathi keys {d}`")
    public, secret = zmq.auth.load_certificate(secret_file)
    if secret is None:
        raise LinkSecurityError(f"{secret_file} holds no secret key")
    if role == "scheduler":
        if not (d / "worker.key").is_file():
            raise LinkSecurityError(f"no worker.key in {d}: a scheduler needs the workers' public key")
        server, _ = zmq.auth.load_certificate(d / "worker.key")
        return LinkKeys(role, public, secret, _check_key(server, "worker.key"))
    if not (d / SCHEDULERS_FILE).is_file():
        raise LinkSecurityError(f"no {SCHEDULERS_FILE} in {d}: a worker needs the schedulers' public keys")
    schedulers = _key_list((d / SCHEDULERS_FILE).read_text(), SCHEDULERS_FILE)
    workers = (_key_list((d / WORKERS_FILE).read_text(), WORKERS_FILE)
               if (d / WORKERS_FILE).is_file() else frozenset({public}))
    return _worker_keys(public, secret, schedulers, workers)


def _worker_keys(public: bytes, secret: bytes, schedulers: frozenset, workers: frozenset) -> LinkKeys:
    if not schedulers:
        raise LinkSecurityError("no scheduler key is authorized: nobody could drive this worker")
    return LinkKeys("worker", public, secret, public, schedulers, workers or frozenset({public}))


def load_keys_env(role: str, env: Mapping[str, str]) -> LinkKeys | None:
    """A process's keys from SARATHI_LINK_* variables holding the keys themselves; None when
    SARATHI_LINK_SECRET_KEY is unset."""
    raw = env.get(ENV_SECRET, "").strip()
    if not raw:
        return None
    secret = _check_key(raw.encode(), ENV_SECRET)
    public = zmq.curve_public(secret)
    if role == "scheduler":
        server = env.get(ENV_SERVER, "").strip()
        if not server:
            raise LinkSecurityError(f"{ENV_SECRET} is set but {ENV_SERVER} (the workers' public key) is not")
        return LinkKeys(role, public, secret, _check_key(server.encode(), ENV_SERVER))
    return _worker_keys(public, secret, _key_list(env.get(ENV_SCHEDULERS, ""), ENV_SCHEDULERS),
                        _key_list(env.get(ENV_WORKERS, ""), ENV_WORKERS))


def load_keys(role: str, env: Mapping[str, str] | None = None) -> LinkKeys | None:
    """This role's keys from SARATHI_LINK_KEYS (a directory) or else from the key variables;
    None when neither is set (plain links)."""
    env = os.environ if env is None else env
    key_dir = env.get(ENV_DIR, "").strip()
    return load_keys_dir(role, key_dir) if key_dir else load_keys_env(role, env)


_process_keys: dict[str, LinkKeys | None] = {}


def process_keys(role: str) -> LinkKeys | None:
    """load_keys(role) from this process's environment, read once (a process has one identity)."""
    if role not in _process_keys:
        _process_keys[role] = load_keys(role)
    return _process_keys[role]


def use_settings(key_dir: str | None, insecure: bool) -> None:
    """Make this process (and the processes it starts) use the link keys in key_dir and/or allow
    plain links on network addresses: the command line's --link-keys / --insecure-links."""
    if key_dir:
        os.environ[ENV_DIR] = str(key_dir)
    if insecure:
        os.environ[ENV_INSECURE] = "1"
    _process_keys.clear()


def insecure_allowed(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get(ENV_INSECURE, "").lower() in ("1", "true", "yes", "on")


# ---------------------------------------------------------------------------------------------
# addresses
# ---------------------------------------------------------------------------------------------
def tcp_host(address: str) -> str | None:
    """The host of a tcp:// address ("*" for a wildcard), None for ipc:// and inproc://."""
    if not address.startswith("tcp://"):
        return None
    host = address.removeprefix("tcp://").rpartition(":")[0]
    return host.strip("[]") or "*"


def is_loopback(address: str) -> bool:
    """True for a tcp:// address on a loopback host (127.0.0.0/8, ::1, localhost)."""
    host = tcp_host(address)
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:   # a name or a wildcard: not provably loopback
        return False


def uses_curve(address: str, keys: LinkKeys | None) -> bool:
    """CURVE on tcp:// links when keys are configured; ipc:// and inproc:// stay on the machine."""
    return keys is not None and address.startswith("tcp://")


def check_bind(address: str, keys: LinkKeys | None, what: str) -> None:
    """Refuse a plain socket on a network address (see the module doc); warn when allowed."""
    if keys is not None or tcp_host(address) is None or is_loopback(address):
        return
    if not insecure_allowed():
        raise LinkSecurityError(
            f"{what} would listen on {address} without link keys: anyone who reaches that address "
            f"could drive it. Configure keys ({ENV_DIR}=DIR from `sarathi keys DIR`, or {ENV_SECRET} ...), "
            f"bind a loopback address, or set {ENV_INSECURE}=1 on a network you trust")
    log.warning("%s listens on %s WITHOUT authentication (%s=1): anyone who reaches this address can "
                "drive it", what, address, ENV_INSECURE)


# ---------------------------------------------------------------------------------------------
# sockets
# ---------------------------------------------------------------------------------------------
class _Allowed:
    """The ZAP credentials provider of one server socket: its allow-list of client keys. A refused
    key is logged once (up to 100 distinct keys), so a misconfigured peer shows in the log
    without a stranger being able to flood it."""

    def __init__(self, keys: Iterable[bytes]):
        self.keys = frozenset(keys)
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        if len(self.refused) < 100 and key not in self.refused:
            self.refused.add(key)
            log.warning("refused a link from an unauthorized key %s", key.decode(errors="replace"))
        return False


_auth_lock = threading.Lock()
_authenticators: dict[int, tuple[zmq.Context, ThreadAuthenticator]] = {}
_domains = itertools.count()


def _authenticator(ctx: zmq.Context) -> ThreadAuthenticator:
    """The one ZAP handler of `ctx` (libzmq allows one per context), started on first use and
    kept for the context's life. Each server socket registers its own ZAP domain with it."""
    with _auth_lock:
        entry = _authenticators.get(id(ctx))
        if entry is None or entry[0] is not ctx or entry[0].closed:
            auth = ThreadAuthenticator(ctx, log=logging.getLogger("sarathi.links.zap"))
            auth.start()
            entry = _authenticators[id(ctx)] = (ctx, auth)
        return entry[1]


def serve_curve(sock: zmq.Socket, keys: LinkKeys, allowed: Iterable[bytes], ctx: zmq.Context) -> str:
    """Make `sock` (not bound yet) a CURVE server that accepts only the `allowed` client keys;
    returns its ZAP domain (pass it to release_domain when the socket closes). Messages it
    receives carry the client's z85 public key as their "User-Id" property (peer_key)."""
    domain = f"sarathi-{next(_domains)}"
    _authenticator(ctx).configure_curve_callback(domain, _Allowed(allowed))
    sock.zap_domain = domain.encode()
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    return domain


def release_domain(ctx: zmq.Context, domain: str | None) -> None:
    """Forget a closed socket's allow-list."""
    if domain is None:
        return
    with _auth_lock:
        entry = _authenticators.get(id(ctx))
    if entry is not None and entry[0] is ctx:
        entry[1].credentials_providers.pop(domain, None)


def stop_authenticator(ctx: zmq.Context) -> None:
    """Stop ctx's ZAP handler (before ctx.term(): its thread holds a socket of the context). The
    shared Context.instance() keeps its handler for the life of the process."""
    with _auth_lock:
        entry = _authenticators.pop(id(ctx), None)
    if entry is not None and entry[0] is ctx:
        entry[1].stop()


def connect_curve(sock: zmq.Socket, keys: LinkKeys) -> None:
    """Make `sock` (not connected yet) a CURVE client of a worker (the workers' public key)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public


def peer_key(frame: zmq.Frame) -> bytes | None:
    """The z85 public key of the CURVE client that sent `frame` (received with copy=False); None
    on a plain link."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return user.encode() if isinstance(user, str) and user != "anonymous" else None


def bound(sock: zmq.Socket, *, max_msg_bytes: int, sndhwm: int = 1000, rcvhwm: int = 1000,
          sndtimeo_ms: int = -1) -> zmq.Socket:
    """Bound what `sock` can buffer: max_msg_bytes per incoming message (a larger one drops the
    connection), at most sndhwm / rcvhwm messages queued per peer, and a send that waits at most
    sndtimeo_ms for room (-1: as long as it takes; then zmq.Again). LINGER 0: a close never
    waits for a stuck peer."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, int(max_msg_bytes))
    sock.setsockopt(zmq.SNDHWM, int(sndhwm))
    sock.setsockopt(zmq.RCVHWM, int(rcvhwm))
    sock.setsockopt(zmq.SNDTIMEO, int(sndtimeo_ms))
    return sock


# ---------------------------------------------------------------------------------------------
# KV transfer announcements: the scheduler tells a KV receiver which transfers to accept
# ---------------------------------------------------------------------------------------------
MAX_LEASE_S = 3600.0


def kv_expect_msg(req_id: str, blocks: list[int], lease_s: float) -> dict:
    """Scheduler -> KV receiver (one frame, no reply): accept one transfer for `req_id` into
    exactly `blocks` (the receiver's block ids, in order), arriving within lease_s seconds of
    this announcement's arrival."""
    return {"op": "expect", "req_id": req_id, "blocks": list(blocks), "lease_s": float(lease_s)}


def kv_cancel_msg(req_id: str) -> dict:
    """Scheduler -> KV receiver: the transfer for `req_id` was given up on; accept nothing for it."""
    return {"op": "cancel", "req_id": req_id}

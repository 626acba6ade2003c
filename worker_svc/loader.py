"""Read a model's weights from disk as Hugging Face-named tensors, one tensor at a time.

Two sources (see shared.model_source): a GGUF file, dequantized with gguf.quants (Q4_1, Q8_0,
...), with llama.cpp's q/k row permutation undone; or a Hugging Face directory of
config.json + *.safetensors. Every failure is a ModelLoadError naming the file and the problem;
names and shapes are checked before the caller allocates anything else.

The weights are a lazy mapping (LazyWeights): a tensor is read from its file (memory-mapped)
when the model asks for it and converted right away to the target dtype and device, so an 8B
model goes to the GPU tensor by tensor in bf16 instead of passing through 32 GB of fp32 host
memory. Values are those of the eager reading: conversion is per element, so it commutes with the
concatenations and slices the model does afterwards.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from shared.gguf_file import GgufFile
from shared.model_source import ModelSource
from worker_svc.gguf_blocks import BLOCK_FORMATS, GgufBlocks
from worker_svc.model_config import ModelConfig, ModelConfigError

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """The model files exist but cannot be used (corrupt, truncated, missing tensors)."""


class LazyWeights(Mapping):
    """name -> tensor, read when asked for (each access reads again: the model takes each once)
    and converted to (dtype, device) when those are set. shapes: name -> shape, known up front."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], read: Callable[[str], torch.Tensor],
                 path: Path, dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        self.shapes, self._read, self.path = shapes, read, path
        self.dtype, self.device = dtype, device

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        try:
            t = self._read(name)
        except Exception as e:   # a corrupt or truncated tensor surfaces here, named
            raise ModelLoadError(f"cannot read tensor {name!r} of model {str(self.path)!r}: "
                                 f"{type(e).__name__}: {e}") from e
        blocks = GgufBlocks.of(t)
        t = t.to(device=self.device, dtype=self.dtype)
        if blocks is not None:      # the file's blocks travel with the float weight (a new tensor
            t.gguf_blocks = blocks  # after a dtype change): see worker_svc/gguf_blocks.py
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


Weights = Mapping[str, torch.Tensor]

# llama.cpp tensor names -> Hugging Face names (per-layer ones keep their block index).
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
               "tokenizer.ggml.scores")


def load_weights(source: ModelSource, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> tuple[ModelConfig, LazyWeights]:
    """(config, weights) of a resolved model; weights use HF names and layouts and arrive in
    `dtype` on `device` (None: as stored, float32 for GGUF, on the CPU)."""
    try:
        cfg, weights = _load_gguf(source.path) if source.kind == "gguf" else _load_hf(source.path)
        weights.dtype, weights.device = dtype, device
    except (ModelLoadError, ModelConfigError):
        raise
    except Exception as e:   # gguf / safetensors raise many types on garbage; name the file
        raise ModelLoadError(f"cannot read model {str(source.path)!r} (corrupt or truncated file?): "
                             f"{type(e).__name__}: {e}") from e
    check_weights(cfg, weights, source.path)
    return cfg, weights


def read_config(source: ModelSource) -> ModelConfig:
    """The model's architecture only (config.json, or GGUF metadata without dequantizing any
    tensor): cheap, so start-up checks (e.g. tensor-parallel divisibility) run before the weights
    are read."""
    try:
        if source.kind != "gguf":
            path = source.path / "config.json"
            gen_path = source.path / "generation_config.json"
            return ModelConfig.from_hf(json.loads(path.read_text()),
                                       json.loads(gen_path.read_text()) if gen_path.is_file() else None)
        reader = GgufFile(source.path)
        return ModelConfig.from_gguf(_gguf_meta(reader), has_output_weight=any(t.name == "output.weight"
                                                                               for t in reader.tensors))
    except ModelConfigError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot read the config of model {str(source.path)!r}: "
                             f"{type(e).__name__}: {e}") from e


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the model needs."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv, ffn = cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn)})
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def check_weights(cfg: ModelConfig, weights: Weights, path: Path) -> None:
    """Names and shapes (read from the headers for LazyWeights: nothing is loaded)."""
    shapes = weights.shapes if isinstance(weights, LazyWeights) else {n: t.shape for n, t in weights.items()}
    for name, shape in expected_shapes(cfg).items():
        if name not in shapes:
            raise ModelLoadError(f"model {str(path)!r} lacks tensor {name!r}")
        if tuple(shapes[name]) != shape:
            raise ModelLoadError(f"model {str(path)!r}: tensor {name!r} has shape "
                                 f"{tuple(shapes[name])}, expected {shape}")


# ---------------------------------------------------------------------------------------------
# Hugging Face directory
# ---------------------------------------------------------------------------------------------
def _load_hf(path: Path) -> tuple[ModelConfig, LazyWeights]:
    from safetensors import safe_open

    cfg_json = json.loads((path / "config.json").read_text())
    gen_path = path / "generation_config.json"
    gen_json = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    cfg = ModelConfig.from_hf(cfg_json, gen_json)
    files, shapes = {}, {}
    for file in sorted(path.glob("*.safetensors")):
        f = safe_open(str(file), framework="pt")     # memory-mapped; tensors read on access
        for name in f.keys():
            files[name] = f
            shapes[name] = tuple(f.get_slice(name).get_shape())
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)   # some checkpoints store the tied copy; it is the same
    return cfg, LazyWeights(shapes, lambda name: files[name].get_tensor(name), path)


# ---------------------------------------------------------------------------------------------
# GGUF file
# ---------------------------------------------------------------------------------------------
def _gguf_meta(reader: GgufFile) -> dict:
    """The metadata ModelConfig.from_gguf reads; the vocabulary only as its size."""
    meta = {k: v for k, v in reader.fields.items() if k not in _BIG_ARRAYS}
    if "tokenizer.ggml.tokens" in reader.fields:
        meta["tokenizer.ggml.tokens"] = range(len(reader.fields["tokenizer.ggml.tokens"]))
    return meta


def _load_gguf(path: Path) -> tuple[ModelConfig, Weights]:
    import gguf

    reader = GgufFile(path)
    names = {t.name for t in reader.tensors}
    cfg = ModelConfig.from_gguf(_gguf_meta(reader), has_output_weight="output.weight" in names)
    if "rope_freqs.weight" in names:
        raise ModelLoadError(f"{str(path)!r}: GGUF rope frequency factors (Llama 3.1 scaling) "
                             "are not supported; use the Hugging Face directory instead")
    tensors, shapes = {}, {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is not None:
            tensors[name] = t
            shapes[name] = tuple(int(s) for s in reversed(t.shape))   # GGUF lists dims innermost first

    def read(name: str) -> torch.Tensor:
        """The exactly dequantized float tensor; a matrix in a block format with a kernel also
        carries its blocks (rows permuted like the float rows), which a backend may compute on."""
        t = tensors[name]
        array = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shapes[name])
        tensor = torch.from_numpy(np.array(array, dtype=np.float32))   # copy: memmap is read-only
        blocks = None
        if len(shapes[name]) == 2 and int(t.tensor_type) in BLOCK_FORMATS:
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(shapes[name][0], -1))
            blocks = GgufBlocks(int(t.tensor_type), raw, shapes[name][1])
        elif len(shapes[name]) == 2 and t.tensor_type.name not in ("F32", "F16", "BF16"):
            log.info("%s: GGUF format %s has no block kernel: dequantized to float32 at load",
                     name, t.tensor_type.name)
        if cfg.model_type == "llama" and name.startswith("model.layers."):
            tensor = _unpermute_qk(name, tensor, cfg)
            if blocks is not None:
                blocks = GgufBlocks(blocks.ggml_type, _unpermute_qk(name, blocks.data, cfg), blocks.cols)
        if blocks is not None:
            tensor.gguf_blocks = blocks
        return tensor

    return cfg, LazyWeights(shapes, read, path)


def _hf_name(gguf_name: str) -> str | None:
    base, _, kind = gguf_name.rpartition(".")
    if base in _GGUF_TOP:
        return f"{_GGUF_TOP[base]}.{kind}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _GGUF_LAYER:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}.{kind}"
    return None


def _unpermute_qk(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """llama.cpp's converter interleaves the two rotary halves of each q/k head (its RoPE
    rotates adjacent pairs); HF rotates halves. Undo: per head, rows (pair, 2) -> (2, pair)."""
    if ".self_attn.q_proj." in name:
        heads = cfg.num_heads
    elif ".self_attn.k_proj." in name:
        heads = cfg.num_kv_heads
    else:
        return t
    rest = t.shape[1:]
    return (t.reshape(heads, t.shape[0] // heads // 2, 2, *rest)
            .transpose(1, 2).reshape(t.shape).contiguous())

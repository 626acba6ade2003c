"""Read a model's weights from disk into Hugging Face-named float32 tensors.

Two sources (see shared.model_source): a GGUF file, dequantized with gguf.quants (Q4_1, Q8_0,
...), with llama.cpp's q/k row permutation undone; or a Hugging Face directory of
config.json + *.safetensors. Every failure is a ModelLoadError naming the file and the problem,
raised before the caller allocates anything else.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from shared.model_source import ModelSource
from worker_svc.model.config import ModelConfig, ModelConfigError

Weights = dict[str, torch.Tensor]

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


class ModelLoadError(RuntimeError):
    """The model files exist but cannot be used (corrupt, truncated, missing tensors)."""


def load_weights(source: ModelSource) -> tuple[ModelConfig, Weights]:
    """(config, weights) of a resolved model; weights use HF names and layouts, float32/orig."""
    try:
        cfg, weights = _load_gguf(source.path) if source.kind == "gguf" else _load_hf(source.path)
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
        import gguf

        reader = gguf.GGUFReader(str(source.path))
        meta = {k: f.contents() for k, f in reader.fields.items() if k not in _BIG_ARRAYS}
        if "tokenizer.ggml.tokens" in reader.fields:
            meta["tokenizer.ggml.tokens"] = range(len(reader.fields["tokenizer.ggml.tokens"].data))
        return ModelConfig.from_gguf(meta, has_output_weight=any(t.name == "output.weight"
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
    for name, shape in expected_shapes(cfg).items():
        if name not in weights:
            raise ModelLoadError(f"model {str(path)!r} lacks tensor {name!r}")
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(f"model {str(path)!r}: tensor {name!r} has shape "
                                 f"{tuple(weights[name].shape)}, expected {shape}")


# ---------------------------------------------------------------------------------------------
# Hugging Face directory
# ---------------------------------------------------------------------------------------------
def _load_hf(path: Path) -> tuple[ModelConfig, Weights]:
    from safetensors import safe_open

    cfg_json = json.loads((path / "config.json").read_text())
    gen_path = path / "generation_config.json"
    gen_json = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    cfg = ModelConfig.from_hf(cfg_json, gen_json)
    weights: Weights = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name)
    if cfg.tie_word_embeddings and "lm_head.weight" in weights:
        del weights["lm_head.weight"]    # some checkpoints store the tied copy; it is the same
    return cfg, weights


# ---------------------------------------------------------------------------------------------
# GGUF file
# ---------------------------------------------------------------------------------------------
def _load_gguf(path: Path) -> tuple[ModelConfig, Weights]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if k not in _BIG_ARRAYS}
    if "tokenizer.ggml.tokens" in reader.fields:
        meta["tokenizer.ggml.tokens"] = range(len(reader.fields["tokenizer.ggml.tokens"].data))
    names = {t.name for t in reader.tensors}
    cfg = ModelConfig.from_gguf(meta, has_output_weight="output.weight" in names)
    if "rope_freqs.weight" in names:
        raise ModelLoadError(f"{str(path)!r}: GGUF rope frequency factors (Llama 3.1 scaling) "
                             "are not supported; use the Hugging Face directory instead")
    weights: Weights = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        shape = tuple(int(s) for s in reversed(t.shape))     # GGUF lists dims innermost first
        array = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        tensor = torch.from_numpy(np.array(array, dtype=np.float32))   # copy: memmap is read-only
        if cfg.model_type == "llama" and name.startswith("model.layers."):
            tensor = _unpermute_qk(name, tensor, cfg)
        weights[name] = tensor
    return cfg, weights


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

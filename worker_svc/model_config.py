"""The architecture of a Llama-family model, read from a Hugging Face config.json or from
GGUF metadata. One dataclass for Llama 2/3, Mistral, Qwen2 and SmolLM: they differ only in
the fields below (q/k/v bias, rope scaling, tied embeddings, GQA ratio). A leaf module below the
loader (which reads it), the model and the device backends (which size their buffers from it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class ModelConfigError(ValueError):
    """A config we cannot run (unknown architecture, inconsistent sizes)."""


@dataclass
class ModelConfig:
    """Sizes are counts (layers, heads) or widths (hidden units); lengths are in tokens."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int   # tokens: the context window
    rope_scaling: dict[str, Any] | None = None   # e.g. {"rope_type": "llama3", "factor": 8, ...}
    attention_bias: bool = False   # bias on q/k/v projections (Qwen2)
    tie_word_embeddings: bool = False
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(f"unsupported model_type {self.model_type!r}; "
                                   f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_heads {self.num_heads} is not a multiple of "
                                   f"num_kv_heads {self.num_kv_heads}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None) -> "ModelConfig":
        """From config.json (transformers 4.x `rope_scaling`/`rope_theta` or 5.x `rope_parameters`)."""
        model_type = cfg.get("model_type", "")
        num_heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = (generation_cfg or {}).get("eos_token_id", cfg.get("eos_token_id"))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope_scaling=rope if rope_type != "default" else None,
            # Qwen2 always has q/k/v bias; Llama/Mistral only when attention_bias says so.
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            eos_token_ids=_as_list(eos),
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], has_output_weight: bool) -> "ModelConfig":
        """From GGUF key/values (meta: key -> python value). Only architecture 'llama' here:
        llama.cpp writes Mistral and SmolLM as 'llama' too."""
        arch = meta.get("general.architecture")
        if arch not in ("llama", "qwen2"):
            raise ModelConfigError(f"unsupported GGUF architecture {arch!r}")

        def key(name: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise ModelConfigError(f"GGUF metadata lacks {arch}.{name}")
            return value

        num_heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
        return cls(
            model_type=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=int(key("rope.dimension_count", hidden // num_heads)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length")),
            attention_bias=arch == "qwen2",
            tie_word_embeddings=not has_output_weight,
            eos_token_ids=sorted(set(int(e) for e in eos)),
        )


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]

"""Rotary position embeddings, Hugging Face convention (rotate_half: the two halves of a head
are the real and imaginary parts). GGUF q/k weights are un-permuted at load time to match.

cos/sin are precomputed in float32 for positions 0 .. max_positions - 1 and looked up by
position, so a token's rotation depends only on its absolute position (what makes chunked
prefill exact).
"""
from __future__ import annotations

import math

import torch

from worker_svc.model_config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/d), rescaled for llama3-style rope scaling. Shape [head_dim/2]."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type != "default":
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: llama3, linear)")
    return inv_freq


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables [max_positions, head_dim] (float32). Look them up once per batch with
    tables(); every layer rotates q [T, Hq, D] and k [T, Hkv, D] with the backend's
    ops.rotary (worker_svc/backends/base.py Ops: the HF rotate_half reference)."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        inv_freq = inverse_frequencies(cfg)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)             # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._cos_sin_cache: torch.Tensor | None = None

    def cos_sin_cache(self) -> torch.Tensor:
        """The same tables as one [max_positions, head_dim] float32 tensor, cos of the head's
        first half then sin of it (the layout vLLM's and FlashInfer's rotary kernels read); made
        on first use, on the tables' device, and kept."""
        if self._cos_sin_cache is None:
            half = self.cos.shape[1] // 2
            self._cos_sin_cache = torch.cat([self.cos[:, :half], self.sin[:, :half]], dim=-1).contiguous()
        return self._cos_sin_cache

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] in `dtype` for positions [T] (int64)."""
        return (self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype))

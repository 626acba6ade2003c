"""The Llama-family transformer (Llama 2/3, Mistral, Qwen2, SmolLM) over a flat hybrid batch.

forward() takes all tokens of an iteration as one row set [T]: every linear layer runs once
over all rows (decodes piggyback on the prefill chunk); only attention looks at sequence
boundaries (the backend's attention). The LM head runs only on `logit_rows`.

Weights come from worker_svc.loader as a dict of Hugging Face names -> tensors, already in
HF layout (GGUF q/k rows un-permuted), and are cast to `dtype` here. Attention and the linear
layers' arithmetic come from the worker's DeviceBackend; nothing here depends on the device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_svc.backends import DeviceBackend
from worker_svc.gguf_blocks import GgufBlocks
from worker_svc.kv_cache import PagedKVCache
from worker_svc.model.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, TensorParallel
from worker_svc.model.rope import RotaryEmbedding
from worker_svc.model_config import ModelConfig


class RMSNorm(torch.nn.Module):
    """The weight [H] and eps of an RMSNorm; the arithmetic is the backend's (ops.rms_norm,
    ops.add_rms_norm: fp32 normalisation like HF, which matters for bf16)."""

    def __init__(self, weight: torch.Tensor, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.to(dtype), requires_grad=False)
        self.eps = eps


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str,
                 index: int, tp: TensorParallel, dtype: torch.dtype, backend: DeviceBackend):
        super().__init__()
        a, m = prefix + "self_attn.", prefix + "mlp."
        lin = backend.linear
        bias = [w[a + f"{p}_proj.bias"] for p in "qkv"] if cfg.attention_bias else None
        self.qkv = ColumnParallelLinear([w[a + f"{p}_proj.weight"] for p in "qkv"], bias, tp, dtype, lin)
        self.o_proj = RowParallelLinear(w[a + "o_proj.weight"], w.get(a + "o_proj.bias"), tp, dtype, lin)
        self.gate_up = ColumnParallelLinear([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]],
                                            None, tp, dtype, lin)
        self.down = RowParallelLinear(w[m + "down_proj.weight"], None, tp, dtype, lin)
        self.attention = backend.attention
        self.ops = backend.ops
        self.input_norm = RMSNorm(w[prefix + "input_layernorm.weight"], cfg.rms_norm_eps, dtype)
        self.post_norm = RMSNorm(w[prefix + "post_attention_layernorm.weight"], cfg.rms_norm_eps, dtype)
        self.index = index
        self.num_heads = cfg.num_heads // tp.world_size        # heads on this rank
        self.num_kv_heads = cfg.num_kv_heads // tp.world_size
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: tuple[torch.Tensor, torch.Tensor], cache: PagedKVCache,
                meta) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on hidden state residual + x (vLLM style: the residual add is deferred into
        the next norm, so add + norm is one fused op). residual None: x is the whole hidden state
        (the first layer). Returns (mlp output, residual): the layer's output hidden state is
        their sum. The residual passed in may be overwritten (ops.add_rms_norm)."""
        T, hd, ops = x.shape[0], self.head_dim, self.ops
        if residual is None:
            residual, h = x, ops.rms_norm(x, self.input_norm.weight, self.input_norm.eps)
        else:
            h, residual = ops.add_rms_norm(x, residual, self.input_norm.weight, self.input_norm.eps)
        # heads of q, k, v as strided views of the fused output (one view + 3 slices: cheaper
        # than split + 3 views, ~4 us a layer)
        qkv, nq, nkv = self.qkv(h).view(T, -1, hd), self.num_heads, self.num_kv_heads
        q, k = ops.rotary(qkv[:, :nq], qkv[:, nq:nq + nkv], cos_sin)
        attn = self.attention.forward(q, k, qkv[:, nq + nkv:], cache, self.index, meta, self.scale)
        h, residual = ops.add_rms_norm(self.o_proj(attn.view(T, -1)), residual,
                                       self.post_norm.weight, self.post_norm.eps)
        return self.down(ops.silu_mul(self.gate_up(h))), residual


class LlamaForCausalLM(torch.nn.Module):
    """Embedding -> num_layers x DecoderLayer -> final norm -> LM head (tied or not).

    parallel (worker_svc.parallel.Parallel, None = one rank): this rank holds only its stage's
    layers [start, end) (the embedding on the first stage, norm + LM head on the last), sharded
    by its TP group, with the vocabulary split by rows; the communication is parallel's."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 backend: DeviceBackend, tp: TensorParallel = TensorParallel(), parallel=None):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.parallel = parallel
        if parallel is not None:
            tp = parallel.tp
        start, end = (0, cfg.num_layers) if parallel is None else parallel.layers
        first = parallel is None or parallel.is_first
        last = parallel is None or parallel.is_last
        vocab = (lambda w: w) if parallel is None else parallel.shard_vocab
        embed = weights["model.embed_tokens.weight"]
        self.embed = torch.nn.Parameter(vocab(embed).to(dtype), requires_grad=False) \
            if first or (last and cfg.tie_word_embeddings) else None
        if self.embed is not None and parallel is None:   # a tied LM head may run on the file's blocks
            self.embed.gguf_blocks = GgufBlocks.of(embed)
        # local layer i of this stage is model layer start + i (and layer i of the stage's cache)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(cfg, weights, f"model.layers.{i}.", i - start, tp, dtype, backend)
            for i in range(start, end))
        self.norm = RMSNorm(weights["model.norm.weight"], cfg.rms_norm_eps, dtype) if last else None
        if not last:
            self.lm_head = None
        elif cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            head = weights["lm_head.weight"]
            self.lm_head = torch.nn.Parameter(vocab(head).to(dtype), requires_grad=False)
            if parallel is None:
                self.lm_head.gguf_blocks = GgufBlocks.of(head)
        # the backend's linear method (int8 for small batches on CPU); only the last stage has one
        self.head = ReplicatedLinear(self.lm_head, backend.linear) if last else None
        self.rope = RotaryEmbedding(cfg, cfg.max_position_embeddings)
        self.ops = backend.ops
        # the backend's way to run all layers at once for the batches it can (None: layer by layer)
        self.stack = backend.layer_stack(self.layers) if parallel is None and len(self.layers) else None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                meta, logit_rows: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] int64; meta: the backend's attention metadata of the batch;
        logit_rows: [S] row indices -> logits [S, V] float32. On a pipeline stage: hidden [T, H]
        from the previous stage replaces the embedding, and a stage that is not the last returns
        its hidden states [T, H] instead of logits."""
        par = self.parallel
        if hidden is not None:
            x = hidden
        elif par is None:
            x = F.embedding(input_ids, self.embed)
        else:
            x = par.embed(input_ids, self.embed, self.cfg.vocab_size)
        cos_sin = self.ops.rope_inputs(self.rope, positions, self.dtype)   # once per batch, not per layer
        residual = None
        stacked = self.stack(x, cos_sin, cache, meta) if self.stack is not None else None
        if stacked is not None:
            x, residual = stacked
        else:
            for layer in self.layers:
                x, residual = layer(x, residual, cos_sin, cache, meta)
        if self.norm is None:
            return x if residual is None else x + residual    # the stage's hidden states
        # the final norm is per row: only where logits are needed
        x = x.index_select(0, logit_rows)
        if residual is None:
            x = self.ops.rms_norm(x, self.norm.weight, self.norm.eps)
        else:
            x, _ = self.ops.add_rms_norm(x, residual.index_select(0, logit_rows),
                                         self.norm.weight, self.norm.eps)
        if par is None:
            return self.head(x).float()
        return par.lm_head(x, self.head, self.cfg.vocab_size)

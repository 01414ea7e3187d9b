"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a flat batch and a paged KV
cache."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.attention.metadata import AttentionBackend
from blockserve.kernels import CpuKernels, LayerOpsSource
from blockserve.model.arch import LlamaArchConfig
from blockserve.model.attention_op import attend
from blockserve.model.packed import PackedLinear
from blockserve.model.rope import Rope, RotaryEmbedding, apply_rotary


class Linear(nn.Linear):
    """`nn.Linear` without the random initialization: every weight is loaded (`load_weights`),
    and initializing them all would cost every start time for nothing."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 like the reference implementation."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.backend = backend

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        rope: Rope,
        kv_cache: torch.Tensor,
        plan: Any,
        ops: Any = None,  # our fused operators (LlamaForCausalLM.forward), or None
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if ops is not None:  # q and k rotated in place, in one pass
            cos, sin = rope
            ops.rotary_(
                qkv,
                cos.view(num_tokens, -1),
                sin.view(num_tokens, -1),
                self.num_heads,
                self.num_kv_heads,
            )
        q, k, v = qkv.split_with_sizes([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if ops is None:
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        out = attend(self.backend, q, k, v, kv_cache, plan)  # [num_tokens, heads, dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaArchConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: Any = None) -> torch.Tensor:
        if ops is not None:
            if isinstance(self.gate_up_proj, PackedLinear):  # not one wrapped for LoRA
                return self.down_proj(self.gate_up_proj.silu_and_mul(x, ops))
            return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: Rope,
        kv_cache: torch.Tensor,
        plan: Any,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, kv_cache, plan)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_fused(
        self,
        ops: Any,
        normed: torch.Tensor,  # input_layernorm(residual)
        residual: torch.Tensor,  # the hidden states entering the layer; updated in place
        next_norm: RMSNorm,  # the next layer's input norm, or the model's final norm
        rope: Rope,
        kv_cache: torch.Tensor,
        plan: Any,
    ) -> torch.Tensor:
        """`forward` through our fused operators: each residual add is fused with the norm
        after it, the last with `next_norm`. Leaves the layer's output in `residual` and
        returns `next_norm` of it."""
        attn = self.self_attn(normed, rope, kv_cache, plan, ops)
        norm = self.post_attention_layernorm
        normed = ops.add_rms_norm(residual, attn, norm.weight, norm.eps)
        return ops.add_rms_norm(residual, self.mlp(normed, ops), next_norm.weight, next_norm.eps)


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        # Given its (empty) weight, the embedding skips its random initialization, as `Linear`.
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus its LM head. `forward` returns hidden states for every token;
    `compute_logits` is applied only where a token is sampled. Built with its weights
    allocated but not initialized, for `load_weights` to fill (the RoPE tables are computed).

    The whole step is one `[num_tokens, hidden]` tensor with `positions`; attention goes through
    the backend it is constructed with and the per-step plan it is handed (wrapped for a
    compiled forward: model/attention_op.py). Knows nothing of blocks beyond that plan.
    Parameter names follow Hugging Face's, except that q/k/v and gate/up are fused into
    `qkv_proj` and `gate_up_proj` (one matmul each); `load_weights` maps them. An eager bf16
    forward on a CPU with our kernels runs each layer's norms, residual adds, rotary embedding
    and SiLU through our fused operators (`forward_fused`; csrc/cpu/layer_ops_bf16.cpp), with
    the same results up to a bf16 step here and there.
    """

    def __init__(
        self,
        config: LlamaArchConfig,
        backend: AttentionBackend,
        kernels: LayerOpsSource | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend)
        self.rotary = RotaryEmbedding(
            head_dim=config.head_dim,
            max_positions=config.max_position_embeddings,
            theta=config.rope_theta,
            scaling=config.rope_scaling,
        )
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # The fused layer operators: Triton's on CUDA, our CPU library's once it is loaded;
        # torch's where none is given (an unloaded CpuKernels offers none).
        self.kernels: LayerOpsSource = kernels if kernels is not None else CpuKernels()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # one [2, num_blocks, block_size, kv_heads, dim] per layer
        plan: Any,
        image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        hidden = self.model.embed_tokens(input_ids)
        if image_embeds is not None:  # (rows of the step, the vision tower's tokens for them)
            rows, embeds = image_embeds
            hidden = hidden.index_copy(0, rows, embeds.to(hidden.dtype))
        rope = self.rotary(positions, hidden.dtype)
        # Our fused CPU operators serve an eager forward; a compiled one fuses on its own.
        ops = (
            None
            if torch.compiler.is_compiling()
            else self.kernels.layer_ops(hidden, self.config.head_dim)
        )
        if ops is not None:
            return self._forward_fused(ops, hidden, rope, kv_caches, plan)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden = layer(hidden, rope, kv_cache, plan)
        return self.model.norm(hidden)

    def _forward_fused(
        self,
        ops: Any,
        hidden: torch.Tensor,
        rope: Rope,
        kv_caches: list[torch.Tensor],
        plan: Any,
    ) -> torch.Tensor:
        layers = cast(list[LlamaDecoderLayer], list(self.model.layers))
        # After each layer, the norm that takes its output: the next layer's, then the final.
        next_norms = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        first = layers[0].input_layernorm
        normed = ops.rms_norm(hidden, first.weight, first.eps)
        for layer, next_norm, kv_cache in zip(layers, next_norms, kv_caches, strict=True):
            normed = layer.forward_fused(ops, normed, hidden, next_norm, rope, kv_cache, plan)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_sampled, hidden] → [num_sampled, vocab] in the model's dtype (the sampler
        widens them to float32 where it computes on them)."""
        return self.lm_head(hidden)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the (fused) parameters; returns names loaded.

        Raises KeyError for a tensor name the model does not have.
        """
        params = dict(self.named_parameters())
        cfg = self.config
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        fused = {
            "q_proj": ("qkv_proj", 0, q_size),
            "k_proj": ("qkv_proj", q_size, kv_size),
            "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
            "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
            "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            parts = name.split(".")
            target = name
            if len(parts) >= 2 and parts[-2] in fused:
                fused_name, offset, size = fused[parts[-2]]
                target = ".".join([*parts[:-2], fused_name, parts[-1]])
                params[target].narrow(0, offset, size).copy_(tensor)
            else:
                params[target].copy_(tensor)
            loaded.add(target)
        return loaded

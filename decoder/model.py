"""DeepSeek-3B-MoE, the language model of DeepSeek-OCR (DeepSeek-V1-style MoE with plain MHA).

Modules follow the released keys (`model.embed_tokens`, `model.layers.{i}.self_attn.q_proj`,
`model.layers.{i}.mlp.gate`, `model.norm`, `lm_head`) with one exception: the routed experts are
stored packed, `mlp.experts.gate_up_proj [E, 2I, H]` and `mlp.experts.down_proj [E, H, I]`, so
all experts run as two grouped matmuls over tokens sorted by expert instead of a loop; the loader
packs the released `experts.{e}.{gate,up,down}_proj` keys (decoder/checkpoint.py).
Spec: DeepSeek's `modeling_deepseekv2.py` (MHA path, LlamaAttention) and MoE gate/infer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import DecoderArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # One fused kernel on CUDA (fp32 inside) instead of six; the reference rounds to the
        # activation dtype once more before the weight, a difference of one bf16 rounding.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope(positions: torch.Tensor, head_dim: int, theta: float, dtype):
    """cos, sin [..., head_dim] for integer positions (computed in fp32, like the reference)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x [B, n, T, d]; cos/sin [B, T, d]: rotate-half RoPE."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.addcmul(x * cos[:, None], rotated, sin[:, None])


class KVCache:
    """Keys and values of up to `max_seqs` sequences in fixed slots: [layers, slot, head, pos, d].

    Running sequences occupy slots 0..S-1 (the engine keeps them compact), so a decode step
    reads one contiguous view instead of gathering slots.
    """

    def __init__(self, args: DecoderArgs, max_seqs: int, max_len: int, device, dtype):
        shape = (args.n_layers, max_seqs, args.n_heads, max_len, args.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    def move(self, src: int, dst: int) -> None:
        """Copy slot src into slot dst (compaction when a sequence leaves)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


@dataclass
class CacheStep:
    """How a forward uses the KV cache: prefill B slots, or decode slots 0..S-1."""

    cache: KVCache
    slot: int | None = None  # prefill: row b written into slot `slot + b` at positions 0..T-1
    positions: torch.Tensor | None = None  # decode: [S] position of each slot's new token
    kv_len: int = 0  # decode: attend over cache positions [0, kv_len)


class Attention(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.n_heads, self.head_dim = args.n_heads, args.head_dim
        self.q_proj = nn.Linear(args.hidden, args.hidden, bias=False)
        self.k_proj = nn.Linear(args.hidden, args.hidden, bias=False)
        self.v_proj = nn.Linear(args.hidden, args.hidden, bias=False)
        self.o_proj = nn.Linear(args.hidden, args.hidden, bias=False)

    def forward(self, x, cos, sin, layer: int, step: CacheStep | None):
        bsz, t, _ = x.shape
        q, k, v = (p(x).view(bsz, t, self.n_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if step is None or step.slot is not None:  # whole sequence, causal
            if step is not None:  # rows may be right-padded: causal rows never see the pads
                step.cache.k[layer, step.slot:step.slot + bsz, :, :t] = k
                step.cache.v[layer, step.slot:step.slot + bsz, :, :t] = v
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # one new token per running sequence
            rows = torch.arange(bsz, device=x.device)
            cache_k, cache_v = step.cache.k[layer], step.cache.v[layer]
            cache_k[rows, :, step.positions] = k[:, :, 0]
            cache_v[rows, :, step.positions] = v[:, :, 0]
            keys, values = cache_k[:bsz, :, :step.kv_len], cache_v[:bsz, :, :step.kv_len]
            visible = torch.arange(step.kv_len, device=x.device)[None] <= step.positions[:, None]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None, None])
        return self.o_proj(out.transpose(1, 2).reshape(bsz, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(args.n_experts, args.hidden))
        self.top_k, self.scaling = args.top_k, args.routed_scaling

    def forward(self, x):
        """Greedy top-k of a softmax computed in fp32; weights not renormalised."""
        scores = F.linear(x.float(), self.weight.float()).softmax(dim=-1)
        weights, experts = torch.topk(scores, self.top_k, dim=-1)
        return weights * self.scaling, experts


def grouped_mm(x, w, counts):
    """x [N, K] rows sorted by group, w [G, M, K] (Linear layout), counts [G] -> [N, M]."""
    # One kernel for all groups: Hopper's grouped GEMM in bf16 on CUDA; torch's fallback on CPU.
    if hasattr(torch, "_grouped_mm") and (x.dtype == torch.bfloat16 or not x.is_cuda):
        offs = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    parts = x.split(counts.tolist())
    return torch.cat([p @ w[g].t() for g, p in enumerate(parts)])


class Experts(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(args.n_experts, 2 * args.moe_intermediate, args.hidden))
        self.down_proj = nn.Parameter(torch.zeros(args.n_experts, args.hidden, args.moe_intermediate))

    def forward(self, x, weights, experts):
        """x [N, H]; weights, experts [N, k] -> sum_j weights[:, j] * expert_j(x)."""
        n, k = experts.shape
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # (token, choice) pairs sorted by expert
        # Tokens per expert. scatter_add into a fixed-size buffer: bincount would size its
        # output from the data and so wait on the GPU every layer.
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.long, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        xs = x[order // k]
        gate, up = grouped_mm(xs, self.gate_up_proj, counts).chunk(2, dim=-1)
        ys = grouped_mm(F.silu(gate) * up, self.down_proj, counts)
        # Combine in fp32 as DeepSeek's moe_infer does, then back to the activation dtype.
        out = torch.zeros(n, x.shape[-1], device=x.device, dtype=torch.float32)
        out.index_add_(0, order // k, ys.float() * weights.flatten()[order, None])
        return out.to(x.dtype)


class MoE(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.gate = Gate(args)
        self.experts = Experts(args)
        self.shared_experts = MLP(args.hidden, args.moe_intermediate * args.n_shared_experts)

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts = self.gate(flat)
        return self.experts(flat, weights, experts).view(shape) + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, args: DecoderArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.self_attn = Attention(args)
        self.mlp = MoE(args) if args.is_moe(layer) else MLP(args.hidden, args.intermediate)
        self.input_layernorm = RMSNorm(args.hidden, args.rms_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden, args.rms_eps)

    def forward(self, x, cos, sin, step):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, self.layer, step)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.hidden, args.rms_eps)


class Decoder(nn.Module):
    """`decoder(input_ids=..., inputs_embeds=...)` -> logits [B, T, vocab] (full causal pass);
    with `step`, the same forward reads and writes the generation engine's KV cache;
    `last_only` / `logits_at` ([B] positions) keep one position per row -> [B, 1, vocab]."""

    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.args = args
        self.model = Transformer(args)
        self.lm_head = nn.Linear(args.hidden, args.vocab_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def embed(self, input_ids):
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids=None, inputs_embeds=None, positions=None,
                step: CacheStep | None = None, last_only: bool = False,
                logits_at: torch.Tensor | None = None):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds.to(self.dtype)
        bsz, t, _ = x.shape
        if positions is None:
            positions = torch.arange(t, device=x.device).expand(bsz, t)
        cos, sin = rope(positions, self.args.head_dim, self.args.rope_theta, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, step)
        if last_only:
            x = x[:, -1:]
        elif logits_at is not None:  # one position per row ([B]): right-padded prefills
            x = x[torch.arange(bsz, device=x.device), logits_at][:, None]
        return self.lm_head(self.model.norm(x))

"""DeepEncoder V2's second stage: a Qwen2-0.5B-shaped transformer run as an encoder over
[SAM tokens ; learned queries] (checkpoint prefix `model.qwen2_model.`).

Spec: DeepSeek-OCR-2's `deepencoderv2/qwen2_d2e.py`, which wraps transformers' (4.46) Qwen2Model
with its token embedding deleted and a custom 4D mask. Its wrappers give the keys their double
`model.model.` (`Qwen2Decoder2Encoder.model` is a `CustomQwen2Decoder`, whose `.model` is the
Qwen2Model), kept here so `model.qwen2_model.model.model.layers.3.self_attn.q_proj.weight` loads
with strict=True:

    qwen2_model.query_768.weight   [144, D]   learned queries of a 768² crop (12 x 12 SAM tokens)
    qwen2_model.query_1024.weight  [256, D]   learned queries of a 1024² view (16 x 16)
    qwen2_model.model.model.layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj,
        post_attention_layernorm, mlp.{gate,up,down}_proj}
    qwen2_model.model.model.norm.weight

The sequence is the view's n SAM tokens followed by n queries. Image tokens attend to every image
token (both ways) and to no query; query i attends to every image token and to queries 0..i
("visual causal flow"). Positions are 0..2n-1 for RoPE, as Qwen2Model numbers them. Only the
queries' final states leave (after the final RMSNorm). The mask, cos and sin depend only on n, so
each is made once per view size and read in place: nothing in `forward` depends on data, and a
CUDA graph captured for a view size replays them as they are.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from common import switches

from . import model as sam_model  # its pointwise-kernel helpers (looked up at call time: tests patch them)
from .config import EncoderV2Args

# The causal-flow mask as two mask-free attentions (`flow_attention`); off by default until it is
# measured on a GPU against the masked reference.
SPLIT_FLOW = switches.on("DEEPSEEK_OCR_SPLIT_FLOW_ATTENTION")
# RoPE of q and k in one Triton pass each (`triton_rope.py`, bit for bit `apply_rope`) on a GPU in
# half precision; DEEPSEEK_OCR_ROPE_KERNEL=torch: `apply_rope` (the reference).
ROPE_KERNEL = switches.kernel("DEEPSEEK_OCR_ROPE_KERNEL") != "torch"

# The two learned query tables, named by the side of the view they serve; a view of that side
# has (side / 64)² SAM tokens and as many queries.
QUERY_SIDES = (768, 1024)
_PIXELS_PER_TOKEN_SIDE = 64


@functools.cache
def causal_flow_mask(n_image: int, n_query: int, device: torch.device) -> torch.Tensor:
    """[T, T] bool (T = n_image + n_query), True where row i may attend to column j: every row
    to the image tokens (j < n_image); query rows also to queries up to themselves (j <= i).
    Image rows then see no query, since j <= i < n_image is already an image token.
    A normal tensor even when first made under inference mode (autograd may read it later)."""
    with torch.inference_mode(False):
        idx = torch.arange(n_image + n_query, device=device)
        return (idx[None, :] < n_image) | (idx[None, :] <= idx[:, None])


@functools.cache
def rope_tables(seqlen: int, head_dim: int, theta: float, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [seqlen, head_dim] for positions 0..seqlen-1, computed in fp32 as transformers'
    Qwen2RotaryEmbedding (inverse frequencies from an int64 arange, angles = position x
    frequency, both halves repeated), then cast to the activations' dtype, as it does."""
    with torch.inference_mode(False):
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        inv_freq = 1.0 / (theta ** exponents)
        angles = torch.outer(torch.arange(seqlen, device=device).float(), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, head_dim] rotated by position (the non-interleaved halves of Qwen2)."""
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    """Qwen2RMSNorm: normalised in fp32, cast back, then scaled (the order matters in bf16)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add_and_norm(self, x, delta):
        """(x + delta, this norm of it): the residual stream and the norm's output; with no
        delta (before the first layer), (x, the norm of x). On a GPU in half precision one
        Triton kernel (`triton_norm.rms_norm`; DEEPSEEK_OCR_NORM_KERNEL=0: the add, then
        `forward`, the reference twin)."""
        if sam_model._takes(x, sam_model.NORM_KERNEL) and self.weight.dtype == x.dtype and (
                delta is None or (delta.is_contiguous() and delta.shape == x.shape and delta.dtype == x.dtype)):
            out = sam_model._pointwise_kernels()[0].rms_norm(x, self.weight, self.eps, residual=delta)
            return (x, out) if delta is None else out
        if delta is not None:
            x = x + delta
        return x, self(x)


def flow_attention(q, k, v, mask: torch.Tensor, n_image: int, split: bool) -> torch.Tensor:
    """SDPA over [image tokens ; queries] under the causal-flow mask. `split`: as two attentions
    with no mask tensor, which SDPA's flash and memory-efficient kernels take: the image rows
    over the image keys alone (they see no query), and the query rows over every key, causal
    aligned to the lower right (query i sees the n_image image keys and queries 0..i). The
    reference twin: one SDPA with the boolean mask (which keeps it off the flash kernel)."""
    if not split:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # Imported here: the module imports torch._dynamo (~1-2 s of a replica's start-up).
    from torch.nn.attention.bias import causal_lower_right
    image = F.scaled_dot_product_attention(q[:, :, :n_image], k[:, :, :n_image], v[:, :, :n_image])
    queries = F.scaled_dot_product_attention(
        q[:, :, n_image:], k, v, attn_mask=causal_lower_right(q.shape[2] - n_image, k.shape[2]))
    return torch.cat([image, queries], dim=2)


class Qwen2Attention(nn.Module):
    """Grouped-query attention: q, k, v with biases, o without (Qwen2's attention_bias)."""

    # q, k and v in one matmul of their stacked weights (`packed_qkv`): k's and v's 128 columns
    # alone make narrow matmuls; DEEPSEEK_OCR_FUSED_PROJECTIONS=0: the released three (the twin).
    fused = switches.on("DEEPSEEK_OCR_FUSED_PROJECTIONS")

    def __init__(self, args: EncoderV2Args):
        super().__init__()
        self.split_flow = SPLIT_FLOW  # `flow_attention`'s split (tests set it per module)
        self.heads, self.kv_heads, self.head_dim = args.qwen2_heads, args.qwen2_kv_heads, args.qwen2_head_dim
        self.q_proj = nn.Linear(args.qwen2_width, self.heads * self.head_dim)
        self.k_proj = nn.Linear(args.qwen2_width, self.kv_heads * self.head_dim)
        self.v_proj = nn.Linear(args.qwen2_width, self.kv_heads * self.head_dim)
        self.o_proj = nn.Linear(self.heads * self.head_dim, args.qwen2_width, bias=False)

    def packed_qkv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The q, k and v projections' weights and biases stacked: made once, and again when one
        of them changes (a load writes them in place, which moves their versions; `.to()` makes
        new tensors). A copy beside the parameters (2 MB a layer at real dims), so the
        checkpoint's keys and the modules stay as released."""
        parts = [t for proj in (self.q_proj, self.k_proj, self.v_proj) for t in (proj.weight, proj.bias)]
        key = [(t.data_ptr(), t._version) for t in parts]
        if getattr(self, "_packed_key", None) != key:
            self._packed = (torch.cat([t.detach() for t in parts[0::2]]), torch.cat([t.detach() for t in parts[1::2]]))
            self._packed_key = key
        return self._packed

    def forward(self, x, cos, sin, mask, n_image: int):
        bsz, seqlen, _ = x.shape
        if self.fused:  # column slices of one output: rows strided, as the RoPE kernel takes them
            projected = F.linear(x, *self.packed_qkv())
            q, k, v = projected.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                                       self.kv_heads * self.head_dim], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            projected = q
        if ROPE_KERNEL and sam_model._takes(projected, True):
            from .triton_rope import rope  # Triton is importable where _takes holds
            q, k = rope(q, cos, sin, self.head_dim), rope(k, cos, sin, self.head_dim)
            q = q.view(bsz, seqlen, self.heads, self.head_dim).transpose(1, 2)
            k = k.view(bsz, seqlen, self.kv_heads, self.head_dim).transpose(1, 2)
        else:
            q = apply_rope(q.view(bsz, seqlen, self.heads, self.head_dim).transpose(1, 2), cos, sin)
            k = apply_rope(k.view(bsz, seqlen, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        v = v.view(bsz, seqlen, self.kv_heads, self.head_dim).transpose(1, 2)
        # Key/value head h serves query heads h*rep .. (h+1)*rep-1 (transformers' repeat_kv).
        # Repeated here rather than SDPA's enable_gqa: with a mask, that flag sends CUDA to
        # the math kernel, while repeated heads keep the memory-efficient one.
        rep = self.heads // self.kv_heads
        k = k[:, :, None].expand(-1, -1, rep, -1, -1).reshape(bsz, self.heads, seqlen, self.head_dim)
        v = v[:, :, None].expand(-1, -1, rep, -1, -1).reshape(bsz, self.heads, seqlen, self.head_dim)
        out = flow_attention(q, k, v, mask, n_image, self.split_flow)  # [B, heads, T, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seqlen, self.heads * self.head_dim))


class Qwen2MLP(nn.Module):
    def __init__(self, args: EncoderV2Args):
        super().__init__()
        self.gate_proj = nn.Linear(args.qwen2_width, args.qwen2_mlp_dim, bias=False)
        self.up_proj = nn.Linear(args.qwen2_width, args.qwen2_mlp_dim, bias=False)
        self.down_proj = nn.Linear(args.qwen2_mlp_dim, args.qwen2_width, bias=False)

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if sam_model._takes(gate, sam_model.ACTIVATION_KERNEL):  # one pass, bit for bit the two ops
            return self.down_proj(sam_model._pointwise_kernels()[1].silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


class Qwen2Layer(nn.Module):
    def __init__(self, args: EncoderV2Args):
        super().__init__()
        self.input_layernorm = RMSNorm(args.qwen2_width, args.rms_eps)
        self.self_attn = Qwen2Attention(args)
        self.post_attention_layernorm = RMSNorm(args.qwen2_width, args.rms_eps)
        self.mlp = Qwen2MLP(args)

    def forward(self, x, delta, cos, sin, mask, n_image: int):
        """The residual stream x and the last layer's output not yet added to it (None before
        the first layer) -> the same after this layer: each add happens in the next norm's
        kernel (`RMSNorm.add_and_norm`)."""
        x, h = self.input_layernorm.add_and_norm(x, delta)
        x, h = self.post_attention_layernorm.add_and_norm(x, self.self_attn(h, cos, sin, mask, n_image))
        return x, self.mlp(h)


class Qwen2Layers(nn.Module):
    """transformers' Qwen2Model without its token embedding (`...model.model.`)."""

    def __init__(self, args: EncoderV2Args):
        super().__init__()
        self.layers = nn.ModuleList(Qwen2Layer(args) for _ in range(args.qwen2_depth))
        self.norm = RMSNorm(args.qwen2_width, args.rms_eps)


class Qwen2Decoder(nn.Module):
    """DeepSeek's `CustomQwen2Decoder`: only a wrapper, kept for its `.model` in the keys."""

    def __init__(self, args: EncoderV2Args):
        super().__init__()
        self.model = Qwen2Layers(args)


class Qwen2Encoder(nn.Module):
    """SAM features [B, C, g, g] -> the g*g queries' final states [B, g*g, C]
    (DeepSeek's `Qwen2Decoder2Encoder`, checkpoint prefix `model.qwen2_model.`)."""

    def __init__(self, args: EncoderV2Args):
        super().__init__()
        self.args = args
        self.model = Qwen2Decoder(args)
        for side in QUERY_SIDES:
            setattr(self, f"query_{side}", nn.Embedding((side // _PIXELS_PER_TOKEN_SIDE) ** 2,
                                                        args.qwen2_width))

    def queries(self, n: int) -> torch.Tensor:
        """The learned queries [n, C] of a view with n SAM tokens (chosen by shape, not data)."""
        for side in QUERY_SIDES:
            table = getattr(self, f"query_{side}")
            if table.num_embeddings == n:
                return table.weight
        sides = ", ".join(f"{s}² ({(s // _PIXELS_PER_TOKEN_SIDE) ** 2} tokens)" for s in QUERY_SIDES)
        raise ValueError(f"no learned queries for a view of {n} SAM tokens; DeepEncoder V2 has "
                         f"them for views of {sides}")

    def forward(self, features):
        x = features.flatten(2).transpose(1, 2)  # [B, n, C]
        bsz, n, c = x.shape
        queries = self.queries(n).to(x.dtype).expand(bsz, n, c)
        x = torch.cat([x, queries], dim=1)  # [B, 2n, C]: image tokens, then queries
        mask = causal_flow_mask(n, n, x.device)
        cos, sin = rope_tables(2 * n, self.args.qwen2_head_dim, self.args.rope_theta, x.device, x.dtype)
        stack = self.model.model
        delta = None
        for layer in stack.layers:
            x, delta = layer(x, delta, cos, sin, mask, n)
        # The norm is per token: only the queries' rows leave (the kernel's one pass takes all).
        return stack.norm.add_and_norm(x, delta)[1][:, n:]

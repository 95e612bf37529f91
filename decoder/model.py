"""DeepSeek-3B-MoE, the language model of DeepSeek-OCR (DeepSeek-V1-style MoE with plain MHA).

Modules follow the released keys (`model.embed_tokens`, `model.layers.{i}.self_attn.o_proj`,
`model.layers.{i}.mlp.gate`, `model.norm`, `lm_head`) except where weights that read the same
input are stored packed, so one matmul does the work of several (decoder/checkpoint.py packs the
released keys): the routed experts, `mlp.experts.gate_up_proj [E, 2I, H]` and
`mlp.experts.down_proj [E, H, I]`, run as two grouped matmuls over tokens sorted by expert
instead of a loop; attention's `qkv_proj [3H, H]` holds `q_proj`, `k_proj` and `v_proj`, and
each MLP's `gate_up_proj [2I, H]` (dense and shared experts) its `gate_proj` and `up_proj`.
`Decoder.use_fused_projections(False)` runs every packed projection as the released separate
matmuls (the reference twin).
Unlimited-OCR's decoder (`args.sliding_window` set) is the same but for its reference
sliding-window attention (R-SWA): position q of a row whose prompt has P tokens attends to key
position j when j <= q and (j < P or j > q - window), i.e. to the whole prompt (every image and
text token, however many pages) and to the last `window` positions; prompt positions (q < P)
are therefore plain causal, and a generated token sees the prompt plus the newest `window`
generated tokens, itself included (baidu's `SlidingWindowLlamaAttention`; transformers'
`create_reference_sliding_window_causal_mask`). The evicted keys stay in the cache, masked.
Spec: DeepSeek's `modeling_deepseekv2.py` (MHA path, LlamaAttention) and MoE gate/infer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import switches

from .config import DecoderArgs
from .kv_cache import KVCache

# Prefill attention without cuDNN's SDPA, which PyTorch picks on Hopper: it plans each new
# sequence length on first sight (a fresh node's first page, of a length the warm-up prefill
# had not had, spent 629 ms in its prefill; 73 ms with this: e2e-norm-kernel-2026-12-02.json).
# Flash needs no plan.
PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class RMSNorm(nn.Module):
    # The residual add before the norm in the same kernel (`add_and_norm`): "triton"
    # (decoder/triton_norm.py; on CPU only under Triton's interpreter), "torch" (the add, then
    # `forward`: the reference twin), "auto" (the default): "triton" for half-precision
    # activations on CUDA. DEEPSEEK_OCR_NORM_KERNEL=0: "torch".
    kernel = "auto" if switches.on("DEEPSEEK_OCR_NORM_KERNEL") else "torch"

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # One fused kernel on CUDA (fp32 inside) instead of six; the reference rounds to the
        # activation dtype once more before the weight, a difference of one bf16 rounding.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_and_norm(self, x, delta):
        """(x + delta, the norm of it): the residual stream and this norm's output; with no
        delta (before the first layer), (x, the norm of x). `delta` in x's dtype or in fp32
        (the fused MoE's sum: the kernel adds it unrounded; torch's add rounds it first, as the
        reference MoE does)."""
        if delta is None:
            return x, self(x)
        if self.kernel == "triton" or (self.kernel == "auto" and x.is_cuda and x.element_size() == 2):
            from .triton_norm import add_rms_norm
            return add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta.to(x.dtype)
        return x, self(x)


def rope(positions: torch.Tensor, head_dim: int, theta: float, dtype):
    """cos and signed sin [..., head_dim] for integer positions, computed in fp32 like the
    reference: cos = [cos f, cos f], sin = [-sin f, sin f] (the rotate-half sign folded in)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    freqs = positions.float()[..., None] * inv_freq
    return (torch.cat([freqs, freqs], dim=-1).cos().to(dtype),
            torch.cat([-freqs, freqs], dim=-1).sin().to(dtype))


def apply_rope(x, cos, sin):
    """x [B, n, T, d]; cos/sin [B, T, d] from `rope`: rotate-half RoPE,
    x * cos + [-x2, x1] * [sin, sin] written as x * cos + [x2, x1] * [-sin, sin]
    (one roll instead of a negation and a concatenation; the same values)."""
    return torch.addcmul(x * cos[:, None], x.roll(x.shape[-1] // 2, dims=-1), sin[:, None])


def rswa_mask(t: int, prompt_lens: list[int], window: int, device) -> torch.Tensor | None:
    """R-SWA over a whole pass of t positions (rows' prompts of `prompt_lens` tokens): [B, 1, t, t]
    bool, True where attended; None when it is the causal mask (no position is `window` or more
    past its row's prompt, as in every fresh prompt), so SDPA keeps its causal kernels."""
    if t <= min(prompt_lens) + window:
        return None
    pos = torch.arange(t, device=device)
    q, k = pos[:, None], pos[None, :]
    prompt = torch.tensor(prompt_lens, device=device)[:, None, None]
    return ((k <= q) & ((k < prompt) | (k > q - window)))[:, None]


@dataclass
class CacheStep:
    """How a forward uses the KV cache: prefill B rows, or decode rows 0..S-1."""

    cache: KVCache
    slot: int | None = None  # prefill: row b written into cache row `slot + b` at positions 0..T-1
    positions: torch.Tensor | None = None  # decode: [S] position of each row's new token
    kv_len: int = 0  # decode: every position < kv_len (a static bound: the graph's context)
    prompt_lens: torch.Tensor | None = None  # decode, R-SWA models: [S] each row's prompt length
    # prefill: the rows' page-table rows [B, pages] to write, in place of the cache's rows
    # slot..slot+B-1 (a prefill graph's static copy of its sequence's row: prefill_graphs.py)
    table: torch.Tensor | None = None


def packed_linear(x, weight, parts: int, fused: bool) -> tuple[torch.Tensor, ...]:
    """The `parts` equal row blocks of `weight` applied to x: one matmul split after (`fused`),
    or one matmul per block, as the released separate projections run (the reference)."""
    if fused:
        return F.linear(x, weight).chunk(parts, dim=-1)
    return tuple(F.linear(x, w) for w in weight.chunk(parts, dim=0))


class Attention(nn.Module):
    # One q/k/v matmul and one RoPE call for q and k; False: the reference twin.
    fused = switches.on("DEEPSEEK_OCR_FUSED_PROJECTIONS")
    # RoPE and the KV-cache write of a forward with a cache (packed projections): "triton", one
    # kernel (decoder/triton_rope.py; on CPU only under Triton's interpreter); "torch",
    # apply_rope and KVCache.write_prefill / write_decode (the reference twin); "auto" (the
    # default): "triton" on CUDA.
    rope_kernel = switches.kernel("DEEPSEEK_OCR_ROPE_KERNEL")

    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.n_heads, self.head_dim = args.n_heads, args.head_dim
        self.window = args.sliding_window  # R-SWA (Unlimited-OCR); None: causal
        self.qkv_proj = nn.Linear(args.hidden, 3 * args.hidden, bias=False)
        self.o_proj = nn.Linear(args.hidden, args.hidden, bias=False)

    def forward(self, x, cos, sin, layer: int, step: CacheStep | None, mask=None):
        """`mask`: a whole pass's R-SWA mask (`rswa_mask`), None for causal."""
        bsz, t, _ = x.shape
        prefill = step is not None and step.slot is not None  # rows may be right-padded
        if step is not None and self.fused and (self.rope_kernel == "triton"
                                                or (self.rope_kernel == "auto" and x.is_cuda)):
            qkv = F.linear(x, self.qkv_proj.weight)  # q and k rotated, k and v cached, in one pass
            qk = step.cache.rope_and_write(layer, qkv, cos, sin, self.n_heads, first_row=step.slot or 0,
                                           positions=None if prefill else step.positions, table=step.table)
            q, k = qk[:, :, :self.n_heads].transpose(1, 2), qk[:, :, self.n_heads:].transpose(1, 2)
            v = qkv.view(bsz, t, 3 * self.n_heads, self.head_dim)[:, :, 2 * self.n_heads:].transpose(1, 2)
        else:
            if self.fused:  # q's and k's heads rotated in one call, as [B, 2n, T, d]
                qkv = F.linear(x, self.qkv_proj.weight).view(bsz, t, 3 * self.n_heads, self.head_dim)
                qk = apply_rope(qkv[:, :, :2 * self.n_heads].transpose(1, 2), cos, sin)
                q, k = qk[:, :self.n_heads], qk[:, self.n_heads:]
                v = qkv[:, :, 2 * self.n_heads:].transpose(1, 2)
            else:
                q, k, v = (p.view(bsz, t, self.n_heads, self.head_dim).transpose(1, 2)
                           for p in packed_linear(x, self.qkv_proj.weight, 3, False))
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if prefill:
                step.cache.write_prefill(layer, step.slot, k, v, table=step.table)
            elif step is not None:
                step.cache.write_decode(layer, step.positions, k[:, :, 0], v[:, :, 0])
        if step is None or prefill:  # whole sequence, causal or R-SWA (rows never see their pads)
            with sdpa_kernel(PREFILL_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=mask is None, attn_mask=mask)
            out = out.transpose(1, 2).reshape(bsz, t, -1)
        else:  # one new token per running sequence
            assert self.window is None or step.prompt_lens is not None, "R-SWA decode needs prompt_lens"
            out = step.cache.attend(layer, q, step.positions, step.kv_len, step.prompt_lens, self.window)
        return self.o_proj(out)


class MLP(nn.Module):
    fused = switches.on("DEEPSEEK_OCR_FUSED_PROJECTIONS")  # one gate/up matmul; False: the twin

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        gate, up = packed_linear(x, self.gate_up_proj.weight, 2, self.fused)
        return self.down_proj(F.silu(gate) * up)


class Gate(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(args.n_experts, args.hidden))
        self.top_k, self.scaling = args.top_k, args.routed_scaling

    def forward(self, x):
        """Greedy top-k of a softmax computed in fp32; weights not renormalised."""
        weights, experts = torch.topk(self.logits(x).softmax(dim=-1), self.top_k, dim=-1)
        return weights * self.scaling, experts

    def logits(self, x):
        return F.linear(x.float(), self.weight_fp32())

    def weight_fp32(self) -> torch.Tensor:
        """The weight in fp32 (exact from bf16), converted once: a decode step converted it in
        every MoE layer, one copy kernel each. Converted again when the weight changes (a load
        writes it in place, which moves its version; `.to()` makes a new tensor)."""
        weight = self.weight
        if weight.dtype == torch.float32:
            return weight
        key = (weight.data_ptr(), weight._version)
        if getattr(self, "_fp32_key", None) != key:
            self._fp32, self._fp32_key = weight.detach().float(), key
        return self._fp32


def sort_rows(experts, n_experts: int):
    """experts [N, k] -> (order [N * k]: the (token, choice) pairs sorted by expert, ends
    [n_experts] int32: where each expert's sorted rows end), as both expert implementations take
    them."""
    # Ids below 256 sort as bytes: one radix pass instead of eight for int64 (stable, so
    # the same permutation).
    key_dtype = torch.uint8 if n_experts <= 256 else experts.dtype
    sorted_experts, order = experts.flatten().to(key_dtype).sort(stable=True)
    # Where each expert's rows end, read off the sorted ids on the device (bincount would
    # size its output from the data and so wait on the GPU every layer).
    expert_ids = torch.arange(n_experts, device=experts.device, dtype=key_dtype)
    return order, torch.searchsorted(sorted_experts, expert_ids, right=True, out_int32=True)


def route_reference(logits, top_k: int, scaling: float, n_shared: int):
    """`triton_route.route` in torch's ops (its reference twin): logits [N, E] fp32 ->
    (route_weights [N * K], order [N * K], ends [E + n_shared]), K = top_k + n_shared: the gate's
    picks, then each token's shared experts (ids E.., weight 1), sorted by expert."""
    n, n_experts = logits.shape
    weights, experts = torch.topk(logits.softmax(dim=-1), top_k, dim=-1)
    weights = weights * scaling
    if n_shared:
        experts = torch.cat([experts, torch.arange(n_experts, n_experts + n_shared,
                                                   device=logits.device).expand(n, n_shared)], 1)
        weights = torch.cat([weights, weights.new_ones(n, n_shared)], 1)
    order, ends = sort_rows(experts, n_experts + n_shared)
    return weights.flatten(), order, ends


def grouped_mm(x, w, ends):
    """x [N, K] rows sorted by group, w [G, M, K] (Linear layout), ends [G] int32 (where each
    group's rows end: the cumulative counts) -> [N, M]."""
    # One kernel for all groups: Hopper's grouped GEMM in bf16 on CUDA; torch's fallback on CPU.
    if hasattr(torch, "_grouped_mm") and (x.dtype == torch.bfloat16 or not x.is_cuda):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
    return grouped_mm_loop(x, w, ends)


def grouped_mm_loop(x, w, ends):
    """`grouped_mm` one matmul per group (waits on the GPU for the group sizes): the fallback
    and the reference for the grouped kernel."""
    ends = ends.tolist()
    return torch.cat([x[start:end] @ w[g].t() for g, (start, end) in enumerate(zip([0] + ends, ends))])


class Experts(nn.Module):
    # "grouped_mm": gather, two grouped matmuls, SiLU, weighted index-add (the reference twin);
    # "triton": the two fused kernels of decoder/triton_moe.py (on CPU only under Triton's
    # interpreter), with decode tiles for decode steps and larger ones for prefills. On an
    # H200 they made decode steps 8-19% shorter at 1-256 sequences (decoder_bench, 2026-12-02).
    # "auto" (the default): "triton" for half-precision activations on CUDA, "grouped_mm"
    # elsewhere (fp32 models stay exact: Triton's fp32 dots round their inputs to TF32), and
    # for batches past TRITON_MAX_ROWS (token, choice) rows when that is set (None: no limit).
    kernel = switches.kernel("DEEPSEEK_OCR_MOE_KERNEL")
    TRITON_MAX_ROWS: int | None = None

    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(args.n_experts, 2 * args.moe_intermediate, args.hidden))
        self.down_proj = nn.Parameter(torch.zeros(args.n_experts, args.hidden, args.moe_intermediate))

    def sort_rows(self, experts):
        return sort_rows(experts, self.gate_up_proj.shape[0])

    def uses_triton(self, x, top_k: int) -> bool:
        """Whether this layer's experts run as decoder/triton_moe.py's kernels for x [N, H]."""
        return self.kernel == "triton" or (
            self.kernel == "auto" and x.is_cuda and x.element_size() == 2
            and (self.TRITON_MAX_ROWS is None or x.shape[0] * top_k <= self.TRITON_MAX_ROWS))

    def with_shared(self, x, gate: Gate, shared: MLP):
        """x [N, H] -> the routed experts' weighted sum plus the shared experts' MLP, in the two
        Triton kernels: the shared MLP's weights read in place as experts E.. that every token
        picks with weight 1, and for decode batches the gate and the routing in one kernel as
        well (decoder/triton_route.py). In fp32, as the kernels sum it: the next norm's kernel
        adds it to the residual stream (`RMSNorm.add_and_norm`), so no kernel rounds it to x's
        dtype first. The reference: `forward` + `shared(x)`."""
        from . import triton_route
        from .triton_moe import fused_experts
        n_shared = shared.down_proj.weight.shape[1] // self.down_proj.shape[2]
        if x.shape[0] <= triton_route.MAX_TOKENS:  # the gate's matmul in the route kernel too
            weights, order, ends = triton_route.route(x, gate.weight, gate.top_k, gate.scaling, n_shared)
        else:
            weights, order, ends = route_reference(gate.logits(x), gate.top_k, gate.scaling, n_shared)
        return fused_experts(x, weights, order, ends, self.gate_up_proj, self.down_proj, gate.top_k + n_shared,
                             shared=(shared.gate_up_proj.weight, shared.down_proj.weight),
                             out_dtype=torch.float32)

    def forward(self, x, weights, experts):
        """x [N, H]; weights, experts [N, k] -> sum_j weights[:, j] * expert_j(x)."""
        n, k = experts.shape
        order, ends = self.sort_rows(experts)
        if self.uses_triton(x, k):
            from .triton_moe import fused_experts  # Triton only where this path is asked for
            return fused_experts(x, weights.flatten(), order, ends, self.gate_up_proj, self.down_proj, k)
        token = order // k
        gate, up = grouped_mm(x[token], self.gate_up_proj, ends).chunk(2, dim=-1)
        ys = grouped_mm(F.silu(gate) * up, self.down_proj, ends)
        # Combine in fp32 as DeepSeek's moe_infer does, then back to the activation dtype.
        out = torch.zeros(n, x.shape[-1], device=x.device, dtype=torch.float32)
        out.index_add_(0, token, ys.float() * weights.flatten()[order, None])
        return out.to(x.dtype)


class MoE(nn.Module):
    # The shared experts inside the routed experts' Triton kernels and a decode step's routing
    # in one kernel (`Experts.with_shared`) where those kernels run; False: the shared experts
    # as their own MLP and the routing in torch's ops (the reference twin).
    fused_routing = switches.on("DEEPSEEK_OCR_MOE_FUSED_ROUTING")

    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.gate = Gate(args)
        self.experts = Experts(args)
        self.shared_experts = MLP(args.hidden, args.moe_intermediate * args.n_shared_experts)

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.fused_routing and self.experts.uses_triton(flat, self.gate.top_k):
            return self.experts.with_shared(flat, self.gate, self.shared_experts).view(shape)
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

    def forward(self, x, delta, cos, sin, step, mask=None):
        """The residual stream x and the last layer's output not yet added to it (None before
        the first layer) -> the same after this layer: each add happens in the next norm's
        kernel (`RMSNorm.add_and_norm`)."""
        x, h = self.input_layernorm.add_and_norm(x, delta)
        x, h = self.post_attention_layernorm.add_and_norm(x, self.self_attn(h, cos, sin, self.layer, step, mask))
        return x, self.mlp(h)


class Transformer(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.hidden, args.rms_eps)


class Decoder(nn.Module):
    """`decoder(input_ids=..., inputs_embeds=...)` -> logits [B, T, vocab] (full causal pass);
    with `step`, the same forward reads and writes the generation engine's KV cache;
    `last_only` / `logits_at` ([B] positions) keep one position per row -> [B, 1, vocab].
    R-SWA models: `prompt_lens` (ints, one per row) says where each row's prompt ends in a whole
    pass (a prefill, or a pass without the cache); without it every position counts as prompt
    (plain causal, as transformers' first forward). Decode steps carry theirs in `step`."""

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

    def use_fused_projections(self, on: bool = True) -> None:
        """Each packed projection as one matmul (the default), or `False`: as the released
        separate matmuls, the reference twin for equality tests and A/B benchmarks."""
        for module in self.modules():
            if isinstance(module, (Attention, MLP)):
                module.fused = on

    def use_norm_kernel(self, kernel: str = "auto") -> None:
        """Each residual add and the RMSNorm after it: "torch" (the reference), "triton"
        (decoder/triton_norm.py) or "auto" (the default: "triton" on CUDA in half precision)."""
        self._set_kernel(RMSNorm, "kernel", kernel, ("auto", "torch", "triton"))

    def use_fused_routing(self, on: bool = True) -> None:
        """The shared experts inside the Triton expert kernels and a decode step's routing in one
        kernel (the default, where those kernels run), or `False`: the reference twin."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.fused_routing = on

    def use_rope_kernel(self, kernel: str = "auto") -> None:
        """RoPE and the KV-cache write in every layer: "torch" (the reference), "triton"
        (decoder/triton_rope.py) or "auto" (the default: "triton" on CUDA)."""
        self._set_kernel(Attention, "rope_kernel", kernel, ("auto", "torch", "triton"))

    def use_moe_kernel(self, kernel: str = "auto") -> None:
        """The routed experts' implementation in every MoE layer: "grouped_mm" (the reference),
        "triton" (decoder/triton_moe.py) or "auto" (the default: "triton" on CUDA in bf16)."""
        self._set_kernel(Experts, "kernel", kernel, ("auto", "grouped_mm", "triton"))

    def _set_kernel(self, module_type, attribute: str, kernel: str, allowed: tuple[str, ...]) -> None:
        if kernel not in allowed:
            raise ValueError(f"kernel must be one of {', '.join(map(repr, allowed))}, got {kernel!r}")
        for module in self.modules():
            if isinstance(module, module_type):
                setattr(module, attribute, kernel)

    def embed(self, input_ids):
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids=None, inputs_embeds=None, positions=None,
                step: CacheStep | None = None, last_only: bool = False,
                logits_at: torch.Tensor | None = None, prompt_lens: list[int] | None = None):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds.to(self.dtype)
        bsz, t, _ = x.shape
        if positions is None:
            positions = torch.arange(t, device=x.device).expand(bsz, t)
        cos, sin = rope(positions, self.args.head_dim, self.args.rope_theta, x.dtype)
        mask = None
        whole = step is None or step.slot is not None
        if self.args.sliding_window is not None and prompt_lens is not None and whole:
            if len(prompt_lens) != bsz:
                raise ValueError(f"prompt_lens has {len(prompt_lens)} rows, the batch {bsz}")
            mask = rswa_mask(t, prompt_lens, self.args.sliding_window, x.device)
        delta = None
        for layer in self.model.layers:
            x, delta = layer(x, delta, cos, sin, step, mask)
        if last_only:
            x, delta = x[:, -1:], delta[:, -1:]
        elif logits_at is not None:  # one position per row ([B]): right-padded prefills
            rows = torch.arange(bsz, device=x.device)
            x, delta = x[rows, logits_at][:, None], delta[rows, logits_at][:, None]
        return self.lm_head(self.model.norm.add_and_norm(x, delta)[1])

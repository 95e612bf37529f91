"""The language model against transformers' DeepseekOcr2TextModel, and its checkpoint loading."""
import dataclasses
import json
import os

import pytest
import torch

from common.checkpoint import SINGLE_FILE
from decoder.checkpoint import load_decoder, released_shapes
from decoder.config import DecoderArgs
from decoder.model import Attention, Decoder, Experts, Gate, grouped_mm, grouped_mm_loop
from deployments.model_source import write_random_model
from encoder import CheckpointError, EncoderArgs
from tests.conftest import run_in_triton_interpreter
from tests.helpers import rel_err
from tests.reference import deepseek_ocr2_text_model

# Real head dim (128) and top-6 of 16 experts; small widths and depth.
REF_ARGS = DecoderArgs(vocab_size=512, hidden=256, n_layers=3, n_heads=2, intermediate=384,
                       n_experts=16, moe_intermediate=64, top_k=6, name="reference-test")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    vision = dataclasses.replace(EncoderArgs.tiny(), n_embed=REF_ARGS.hidden)  # the halves agree
    path = write_random_model(tmp_path_factory.mktemp("dec"), vision, REF_ARGS, seed=3, dtype=torch.float32)
    ours = load_decoder(path)
    return ours, deepseek_ocr2_text_model(ours)


def test_logits_match_deepseek_ocr2(pair):
    ours, theirs = pair
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, REF_ARGS.vocab_size, (2, 37), generator=gen)
    with torch.inference_mode():
        expected = ours.lm_head(theirs(input_ids=ids).last_hidden_state)
        got = ours(input_ids=ids)
        embeds = ours.embed(ids) + 0.1 * torch.randn(2, 37, REF_ARGS.hidden, generator=gen)
        expected_e = ours.lm_head(theirs(inputs_embeds=embeds).last_hidden_state)
        got_e = ours(inputs_embeds=embeds)
    assert got.shape == (2, 37, REF_ARGS.vocab_size)
    assert rel_err(got, expected) <= 1e-4 and rel_err(got_e, expected_e) <= 1e-4


def test_expert_choices_match_per_layer(pair):
    ours, theirs = pair
    x = torch.randn(50, REF_ARGS.hidden, generator=torch.Generator().manual_seed(1))
    for layer in range(1, REF_ARGS.n_layers):
        with torch.inference_mode():
            _, our_experts = ours.model.layers[layer].mlp.gate(x)
            _, their_weights, their_experts = theirs.layers[layer].mlp.gate(x)
            our_out = ours.model.layers[layer].mlp(x[None])[0]
            their_out = theirs.layers[layer].mlp(x[None])[0]
        assert torch.equal(our_experts.sort(-1).values, their_experts.sort(-1).values)
        assert rel_err(our_out, their_out) <= 1e-5


def test_fused_projections_equal_the_released_separate_ones(pair):
    """The packed q/k/v and gate/up matmuls (and q and k rotated in one call) against the
    reference twin: the released projections as separate matmuls, the same weights."""
    ours, _ = pair
    ids = torch.randint(0, REF_ARGS.vocab_size, (2, 19), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        fused = ours(input_ids=ids)
        ours.use_fused_projections(False)
        try:
            assert not ours.model.layers[0].self_attn.fused and not ours.model.layers[0].mlp.fused
            separate = ours(input_ids=ids)
        finally:
            ours.use_fused_projections(True)
    assert rel_err(fused, separate) <= 1e-6


def test_gate_converts_its_weight_to_fp32_once_and_again_after_a_load():
    """The routing logits take the gate's weight in fp32: converted at the first call, the same
    tensor after, converted again once a load (in place) or a copy has changed the weight."""
    gate = Gate(DecoderArgs.tiny()).to(torch.bfloat16)
    gate.load_state_dict({"weight": torch.randn(gate.weight.shape)})
    first = gate.weight_fp32()
    assert torch.equal(first, gate.weight.float()) and gate.weight_fp32() is first
    gate.load_state_dict({"weight": torch.randn(gate.weight.shape)})
    second = gate.weight_fp32()
    assert second is not first and torch.equal(second, gate.weight.float())
    x = torch.randn(3, gate.weight.shape[1], dtype=torch.bfloat16)
    with torch.inference_mode():
        assert gate.weight_fp32() is second
        assert torch.equal(gate.logits(x), torch.nn.functional.linear(x.float(), gate.weight.float()))
    assert gate.float().weight_fp32() is gate.weight  # fp32 weights are taken as they are


MOE_KERNELS_IN_INTERPRETER = """
import torch
from decoder.config import DecoderArgs
from decoder.model import MoE
from decoder import triton_moe
from decoder.triton_moe import Tile, fused_experts
torch.manual_seed(0)
args = DecoderArgs(vocab_size=64, hidden=64, n_layers=2, n_heads=1, intermediate=96, n_experts=8,
                   moe_intermediate=48, top_k=3, name="moe-kernel-test")
moe = MoE(args)
with torch.no_grad():
    for p in moe.parameters():
        p.copy_(torch.randn_like(p) * 0.2)
# (tokens, (block_m, block_n, block_k), the down kernel's atomic adds): one token (most experts
# empty), experts with more rows than a block, an intermediate width (48) that is no multiple of
# the column block; the down kernel storing its rows for one sum after (prefill tiles)
for n, blocks, atomic in [(1, (16, 32, 32), True), (5, (16, 16, 16), True), (40, (16, 32, 32), True),
                          (40, (32, 64, 64), True), (40, (16, 32, 32), False), (1, (16, 16, 16), False)]:
    x = torch.randn(n, args.hidden)
    with torch.no_grad():
        weights, experts = moe.gate(x)
        moe.experts.kernel = "grouped_mm"
        reference = moe.experts(x, weights, experts)
        moe.experts.kernel = "triton"
        through_model = moe.experts(x, weights, experts)
        order, ends = moe.experts.sort_rows(experts)
        tile = Tile(*blocks)
        tuned = fused_experts(x, weights.flatten(), order, ends, moe.experts.gate_up_proj,
                              moe.experts.down_proj, args.top_k, tile, tile._replace(atomic_add=atomic))
    rows = int(torch.bincount(experts.flatten(), minlength=8).max())
    print(n, blocks[0], rows, float((tuned - reference).abs().max()))
    assert torch.allclose(tuned, reference, atol=1e-5, rtol=1e-5)
    assert torch.allclose(through_model, reference, atol=1e-5, rtol=1e-5)
# Through the model past PREFILL_ROWS: the module's prefill tiles (the down kernel's stores)
triton_moe.PREFILL_ROWS = 8
assert not triton_moe.PREFILL_DOWN_TILE.atomic_add
with torch.no_grad():
    assert torch.allclose(moe.experts(x, weights, experts), reference, atol=1e-5, rtol=1e-5)
"""


def test_moe_tiles_by_rows(monkeypatch):
    """The expert kernels' tiles by a step's sorted rows: small batches' own (the decode tiles
    where unset), decode batches', prefills'."""
    m = pytest.importorskip("decoder.triton_moe")
    small = (m.SMALL_GATE_UP_TILE, m.SMALL_DOWN_TILE)
    assert None not in small and small != (m.GATE_UP_TILE, m.DOWN_TILE)
    assert m.module_tiles(1) == m.module_tiles(m.SMALL_ROWS) == small
    assert m.module_tiles(m.SMALL_ROWS + 1) == (m.GATE_UP_TILE, m.DOWN_TILE)
    assert m.module_tiles(m.PREFILL_ROWS) == (m.PREFILL_GATE_UP_TILE, m.PREFILL_DOWN_TILE)
    monkeypatch.setattr(m, "SMALL_GATE_UP_TILE", None)
    monkeypatch.setattr(m, "SMALL_DOWN_TILE", None)
    assert m.module_tiles(1) == (m.GATE_UP_TILE, m.DOWN_TILE)


def test_moe_kernels_equal_the_grouped_matmuls_in_triton_interpreter():
    """decoder/triton_moe.py's two kernels, run by Triton's CPU interpreter (fp32), against the
    grouped-matmul experts (the reference twin), directly and through `Experts.kernel`."""
    pytest.importorskip("triton")
    stdout = run_in_triton_interpreter(MOE_KERNELS_IN_INTERPRETER)
    cases = [line.split() for line in stdout.splitlines() if line]
    assert len(cases) == 6 and any(int(rows) > int(block) for _, block, rows, _ in cases), stdout


FUSED_ROUTING_IN_INTERPRETER = """
import torch
from decoder.config import DecoderArgs
from decoder.model import MoE, route_reference
from decoder import triton_route
torch.manual_seed(0)
# route vs route_reference: order and ends exact (stable), weights close
for n, e, k, s in [(1, 8, 3, 2), (5, 8, 3, 0), (37, 64, 6, 2), (64, 66, 6, 2), (16, 8, 8, 1)]:
    x, gate = torch.randn(n, 200), torch.randn(e, 200) / 5  # 200: a partial block of the hidden width
    w, o, en = triton_route.route(x, gate, k, 1.5, s)
    rw, ro, ren = route_reference(x @ gate.T, k, 1.5, s)
    assert torch.equal(en.long(), ren.long()), (en, ren)
    assert torch.equal(o.long(), ro.long()), (o, ro)
    assert torch.allclose(w, rw, atol=1e-6, rtol=1e-5)
    # another tile: hidden steps of 64 (200 = three full and a partial one)
    w2, o2, en2 = triton_route.route(x, gate, k, 1.5, s, triton_route.RouteTile(64, 2, 1))
    assert torch.equal(en2, en) and torch.equal(o2, o) and torch.allclose(w2, rw, atol=1e-6, rtol=1e-5)
    print("route", n, e, k, s, int(en[-1]))
args = DecoderArgs(vocab_size=64, hidden=64, n_layers=2, n_heads=1, intermediate=96, n_experts=8,
                   moe_intermediate=48, top_k=3, n_shared_experts=2, name="moe-kernel-test")
moe = MoE(args)
with torch.no_grad():
    for p in moe.parameters():
        p.copy_(torch.randn_like(p) * 0.2)
for n in (1, 7, 40, 70):
    x = torch.randn(1, n, args.hidden)
    with torch.no_grad():
        moe.experts.kernel = "grouped_mm"
        reference = moe(x)
        moe.experts.kernel = "triton"
        fused = moe(x)
        moe.fused_routing = False
        separate = moe(x)
        moe.fused_routing = True
    print("moe", n, float((fused - reference).abs().max()))
    assert torch.allclose(fused, reference, atol=1e-5, rtol=1e-5)
    assert torch.allclose(separate, reference, atol=1e-5, rtol=1e-5)
"""


def test_fused_routing_equals_the_reference_in_triton_interpreter():
    """decoder/triton_route.py against `route_reference` (the same order and ends: a stable sort;
    the same weights), and the MoE layer with its shared experts inside the Triton expert kernels
    (`MoE.fused_routing`, the route kernel up to MAX_TOKENS and torch's routing past it) against
    the grouped matmuls plus the shared MLP, run by Triton's CPU interpreter (fp32)."""
    pytest.importorskip("triton")
    stdout = run_in_triton_interpreter(FUSED_ROUTING_IN_INTERPRETER)
    lines = [line.split() for line in stdout.splitlines() if line]
    assert [line[0] for line in lines] == ["route"] * 5 + ["moe"] * 4, stdout
    assert int(lines[-1][1]) > 64, "a batch past the route kernel's MAX_TOKENS"


NORM_KERNEL_IN_INTERPRETER = """
import torch
from decoder.checkpoint import random_decoder
from decoder.config import DecoderArgs
from decoder.triton_norm import add_rms_norm
torch.manual_seed(0)
for shape in [(1, 1, 64), (3, 5, 1280), (7, 96)]:  # 1,280: two rows a program, one past the tensor's end
    x, delta, weight = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
    total, y = add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)
    reference = torch.nn.functional.rms_norm(x + delta, (shape[-1],), weight, 1e-6)
    assert torch.allclose(y, reference, atol=1e-5, rtol=1e-5), float((y - reference).abs().max())
# fp16 activations, an fp32 output added (the fused MoE's): summed before rounding, stored in fp16
x, delta, weight = torch.randn(3, 96).half(), torch.randn(3, 96) / 3, torch.randn(96).half()
total, y = add_rms_norm(x, delta, weight, 1e-6)
assert total.dtype == y.dtype == torch.float16 and torch.equal(total, (x.float() + delta).half())
reference = torch.nn.functional.rms_norm(total.float(), (96,), weight.float(), 1e-6)
assert torch.allclose(y.float(), reference, atol=2e-3, rtol=2e-3), float((y.float() - reference).abs().max())
model = random_decoder(DecoderArgs.tiny(), dtype=torch.float32)
ids = torch.randint(0, 259, (2, 9))
with torch.no_grad():
    model.use_norm_kernel("torch")
    reference = model(input_ids=ids)
    model.use_norm_kernel("triton")
    fused = model(input_ids=ids, last_only=True)
    fused_at = model(input_ids=ids, logits_at=torch.tensor([3, 8]))
print(float((fused[:, 0] - reference[:, -1]).abs().max()))
assert torch.allclose(fused[:, 0], reference[:, -1], atol=1e-5, rtol=1e-5)
assert torch.allclose(fused_at[:, 0], reference[[0, 1], [3, 8]], atol=1e-5, rtol=1e-5)
"""


def test_norm_kernel_equals_add_then_rms_norm_in_triton_interpreter():
    """decoder/triton_norm.py (the residual add and the RMSNorm in one kernel), run by Triton's
    CPU interpreter (fp32), against torch's add then `F.rms_norm`, directly and as the whole
    model's norms (`RMSNorm.kernel`), with the last position's and chosen positions' logits."""
    pytest.importorskip("triton")
    assert float(run_in_triton_interpreter(NORM_KERNEL_IN_INTERPRETER)) < 1e-5


ROPE_KERNEL_IN_INTERPRETER = """
import torch
from decoder.checkpoint import random_decoder
from decoder.config import DecoderArgs
from decoder.kv_cache import KVCache, SCRATCH_PAGE
from decoder.model import CacheStep
args = DecoderArgs(vocab_size=64, hidden=64, n_layers=2, n_heads=2, intermediate=96, n_experts=4,
                   moe_intermediate=32, top_k=2, name="rope-kernel-test")
model = random_decoder(args)
# Rows 1 and 2 of the table, right-padded to 70 tokens: row 1 holds 70 (a partial second page),
# row 2 holds 40 (one page: its positions 64..69 go to the scratch page); then rows 0..2 decode
# two tokens each (row 0 from position 63: its second token opens a page)
lengths = torch.tensor([70, 40])
embeds = torch.randn(2, 70, args.hidden)
tokens = torch.randint(3, 64, (2, 3, 1))
out = {}
for kernel in ("torch", "triton"):
    model.use_rope_kernel(kernel)
    cache = KVCache(args.n_layers, args.n_heads, args.head_dim, 8, 4, 256, "cpu", torch.float32)
    for row, n in enumerate((65, 72, 42)):
        cache.reserve(row, n)
    cache.sync()
    with torch.no_grad():
        logits = [model(inputs_embeds=embeds, step=CacheStep(cache, slot=1), logits_at=lengths - 1)]
        for i, ids in enumerate(tokens):
            positions = torch.tensor([63, 70, 40]) + i
            logits.append(model(input_ids=ids, positions=positions[:, None],
                                step=CacheStep(cache, positions=positions, kv_len=128)))
    keep = torch.arange(cache.k.shape[1]) != SCRATCH_PAGE  # nobody reads the scratch page
    out[kernel] = torch.cat([l.flatten() for l in logits]), cache.k[:, keep], cache.v[:, keep]
for name, ref, fused in zip(("logits", "k", "v"), out["torch"], out["triton"]):
    print(name, float((fused - ref).abs().max()), float(ref.abs().max()))
    assert torch.allclose(fused, ref, atol=1e-5, rtol=1e-5), name
"""


def test_rope_kernel_equals_rope_and_cache_writes_in_triton_interpreter():
    """decoder/triton_rope.py (RoPE and the KV-cache write in one kernel), run by Triton's CPU
    interpreter, against apply_rope + KVCache.write_prefill / write_decode: the same logits and
    cache pages for a right-padded prefill whose rows end mid-page and past their pages, then
    decode steps (one opening a page)."""
    pytest.importorskip("triton")
    stdout = run_in_triton_interpreter(ROPE_KERNEL_IN_INTERPRETER)
    errors = {line.split()[0]: float(line.split()[1]) for line in stdout.splitlines() if line}
    assert errors.keys() == {"logits", "k", "v"}, stdout


@pytest.mark.parametrize("switch, module_type, attribute, other, unknown", [
    ("use_rope_kernel", Attention, "rope_kernel", "torch", "cuda"),
    ("use_moe_kernel", Experts, "kernel", "triton", "cutlass")])
def test_kernel_switches(switch, module_type, attribute, other, unknown):
    with torch.device("meta"):
        model = Decoder(REF_ARGS)
    modules = [m for m in model.modules() if isinstance(m, module_type)]
    # attention in every layer; experts in every layer but the dense first
    assert len(modules) == REF_ARGS.n_layers - (module_type is Experts)
    assert all(getattr(m, attribute) == "auto" for m in modules)
    getattr(model, switch)(other)
    assert all(getattr(m, attribute) == other for m in modules)
    getattr(model, switch)()
    assert all(getattr(m, attribute) == "auto" for m in modules)
    with pytest.raises(ValueError, match="kernel must be"):
        getattr(model, switch)(unknown)


def test_grouped_mm_matches_a_loop():
    gen = torch.Generator().manual_seed(2)
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(int(counts.sum()), 16, generator=gen)
    w = torch.randn(4, 24, 16, generator=gen)
    expected = torch.cat([p @ w[g].t() for g, p in enumerate(x.split(counts.tolist()))])
    ends = counts.cumsum(0).to(torch.int32)
    torch.testing.assert_close(grouped_mm(x, w, ends), expected)
    torch.testing.assert_close(grouped_mm_loop(x, w, ends), expected)


def test_real_dims_layout():
    shapes = released_shapes(DecoderArgs())
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (6848, 1280)
    assert shapes["model.layers.1.mlp.experts.63.down_proj.weight"] == (1280, 896)
    assert shapes["model.layers.11.mlp.shared_experts.up_proj.weight"] == (1792, 1280)
    assert shapes["model.layers.5.mlp.gate.weight"] == (64, 1280)
    assert shapes["lm_head.weight"] == (129280, 1280)
    # The released checkpoint: 2,234 language tensors (DeepSeek-OCR notes, 2,710 in all).
    assert len(shapes) == 2234


def test_config_round_trip_and_refusals():
    config = DecoderArgs().to_config()
    assert config["language_config"]["n_routed_experts"] == 64 and config["hidden_size"] == 1280
    assert DecoderArgs.from_config(config) == DecoderArgs()
    assert DecoderArgs.from_config({k: v for k, v in config.items() if k != "language_config"}) == DecoderArgs()
    for key, value in [("use_mla", True), ("topk_method", "noaux_tc"), ("norm_topk_prob", True)]:
        bad = dict(config, language_config=dict(config["language_config"], **{key: value}))
        with pytest.raises(ValueError, match=key):
            DecoderArgs.from_config(bad)


def test_missing_and_misshaped_language_keys(tmp_path):
    from safetensors.torch import load_file, save_file
    path = write_random_model(tmp_path, dtype=torch.float32)
    file = os.path.join(path, SINGLE_FILE)
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    tensors["model.norm.weight"] = torch.zeros(5)
    save_file(tensors, file)
    with pytest.raises(CheckpointError) as e:
        load_decoder(path)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in str(e.value)
    assert "model.norm.weight: checkpoint (5,), model (64,)" in str(e.value)


def test_language_config_missing_field(tmp_path):
    path = write_random_model(tmp_path)
    config = json.load(open(os.path.join(path, "config.json")))
    del config["language_config"]["hidden_size"]
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="hidden_size"):
        load_decoder(path)


@pytest.mark.gpu
def test_real_dims_bf16_cuda():
    """Hopper grouped-GEMM experts against the per-expert loop, and bf16 against fp32 logits."""
    import decoder.model as dm
    from decoder.checkpoint import random_decoder
    args = DecoderArgs()
    bf16 = random_decoder(args, device="cuda", dtype=torch.bfloat16)
    moe = bf16.model.layers[1].mlp
    x = torch.randn(300, args.hidden, device="cuda", dtype=torch.bfloat16)
    bf16.use_moe_kernel("grouped_mm")  # the grouped matmuls themselves, not the Triton kernels
    with torch.inference_mode():
        weights, experts = moe.gate(x)
        grouped = moe.experts(x, weights, experts)
        grouped_mm = dm.grouped_mm
        dm.grouped_mm = dm.grouped_mm_loop
        try:
            looped = moe.experts(x, weights, experts)
        finally:
            dm.grouped_mm = grouped_mm
    torch.testing.assert_close(grouped, looped, rtol=0.016, atol=0.016)
    fp32 = random_decoder(args, device="cuda", dtype=torch.float32)
    ids = torch.randint(0, args.vocab_size, (2, 64), device="cuda")
    with torch.inference_mode():
        logits = bf16(input_ids=ids)
        err = rel_err(logits, fp32(input_ids=ids))
        bf16.use_fused_projections(False)
        separate_err = rel_err(logits, bf16(input_ids=ids))
    print(f"decoder bf16 vs fp32 logits: {err:.2e}; fused vs separate projections (bf16): "
          f"{separate_err:.2e}")
    assert err <= 3e-2 and separate_err <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 256, 4096])  # 4,096: a prefill's tiles
def test_moe_kernels_equal_the_grouped_matmuls_on_gpu(tokens):
    """decoder/triton_moe.py against the grouped-matmul experts at real dims in bf16, each
    measured against the same weights in fp32: the kernels (which keep fp32 where the reference
    rounds to bf16) must be no less accurate than the path they replace, for one MoE layer and
    for one decode-sized forward of the whole model. (The two bf16 paths differ from each other
    by about their own rounding: ~5e-3 for a layer, ~1.5e-2 for the logits after 12 layers.)"""
    from decoder.checkpoint import random_decoder
    args = DecoderArgs()
    fp32 = random_decoder(args, device="cuda", dtype=torch.float32)  # the same seeded weights
    model = random_decoder(args, device="cuda", dtype=torch.bfloat16)
    moe, moe32 = model.model.layers[1].mlp, fp32.model.layers[1].mlp
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    # The whole model's logits over at least 64 tokens: one token's error hangs on whether
    # bf16 rounding flips one of its expert choices somewhere in 12 layers (a coin toss: the
    # two paths measured 1.45e-2 and 2.20e-2 against grouped_mm's 1.8e-2 in two runs).
    ids = torch.randint(0, args.vocab_size, (max(tokens, 64), 1), device="cuda", generator=gen)
    with torch.inference_mode():
        weights, experts = moe.gate(x)
        exact = moe32.experts(x.float(), weights.float(), experts)
        exact_logits = fp32(input_ids=ids)
        del fp32
        model.use_moe_kernel("grouped_mm")
        reference, reference_logits = moe.experts(x, weights, experts), model(input_ids=ids)
        model.use_moe_kernel("triton")
        try:
            fused, fused_logits = moe.experts(x, weights, experts), model(input_ids=ids)
        finally:
            model.use_moe_kernel()
    errs = {name: (rel_err(out, exact), rel_err(logits, exact_logits))
            for name, out, logits in (("grouped_mm", reference, reference_logits),
                                      ("triton", fused, fused_logits))}
    print(f"moe kernels, {tokens} tokens, vs fp32 (experts, logits): "
          + ", ".join(f"{name} {e:.2e} {l:.2e}" for name, (e, l) in errs.items())
          + f"; triton vs grouped_mm {rel_err(fused, reference):.2e} {rel_err(fused_logits, reference_logits):.2e}")
    (ref_err, ref_logits_err), (err, logits_err) = errs["grouped_mm"], errs["triton"]
    assert err <= 1.1 * ref_err and logits_err <= 1.1 * ref_logits_err


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 48, 256])  # 256: past the route kernel's MAX_TOKENS
def test_fused_routing_is_no_less_accurate_than_the_reference_moe_on_gpu(tokens):
    """One MoE layer at real dims in bf16 with the shared experts in the Triton kernels and the
    routing in one kernel (`MoE.fused_routing`) against the same layer with the shared MLP and
    torch's routing, each measured against the fp32 layer: no less accurate. The route kernel's
    order and ends equal `route_reference`'s."""
    from decoder import triton_route
    from decoder.checkpoint import random_decoder
    from decoder.model import route_reference
    args = DecoderArgs()
    moe32 = random_decoder(args, device="cuda", dtype=torch.float32).model.layers[1].mlp
    moe = random_decoder(args, device="cuda", dtype=torch.bfloat16).model.layers[1].mlp
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(1, tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    with torch.inference_mode():
        exact = moe32(x.float())
        moe.fused_routing = False
        reference = moe(x)
        moe.fused_routing = True
        fused = moe(x)
        if tokens <= triton_route.MAX_TOKENS:
            routed = triton_route.route(x[0], moe.gate.weight, args.top_k, args.routed_scaling,
                                        args.n_shared_experts)
            expected = route_reference(moe.gate.logits(x[0]), args.top_k, args.routed_scaling,
                                       args.n_shared_experts)
            assert torch.equal(routed[1].long(), expected[1]) and torch.equal(routed[2], expected[2])
            torch.testing.assert_close(routed[0], expected[0])
    err, ref_err = rel_err(fused, exact), rel_err(reference, exact)
    print(f"fused routing, {tokens} tokens, vs fp32: {err:.2e} (reference {ref_err:.2e}); "
          f"vs reference {rel_err(fused, reference):.2e}")
    assert err <= 1.1 * ref_err


@pytest.mark.gpu
def test_norm_kernel_logits_equal_torch_norms_on_gpu():
    """Real dims, bf16: the whole model's logits with each residual add in its norm's kernel
    against torch's add then RMSNorm (the same roundings but the order of fp32 sums; a bf16
    rounding that goes the other way can flip an expert choice later on, so the bound is the
    bf16-vs-fp32 one of test_real_dims_bf16_cuda, not zero; a lost residual gives ~1)."""
    from decoder.checkpoint import random_decoder
    model = random_decoder(DecoderArgs(), device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 1000, (64, 1), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    with torch.inference_mode():
        fused = model(input_ids=ids)
        model.use_norm_kernel("torch")
        reference = model(input_ids=ids)
        model.use_norm_kernel()
    err = rel_err(fused, reference)
    print(f"norm kernel vs torch norms, logits: {err:.2e}")
    assert err <= 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_rope_kernel_equals_rope_and_cache_writes_on_gpu(cache_dtype):
    """decoder/triton_rope.py at real dims in bf16 against apply_rope + KVCache.write_prefill /
    write_decode, for a prefill and then a decode step: it keeps the reference's bf16 roundings,
    so the cache pages and logits agree but for fused multiply-adds; into an fp8 cache too (the
    kernel's conversion against `kv_cache.stored`: Triton's CPU interpreter gets fp8's rounding
    wrong where it carries into the exponent, 1.99 -> 1.0, so this one needs the GPU)."""
    from decoder.checkpoint import random_decoder
    from decoder.kv_cache import SCRATCH_PAGE, KVCache
    from decoder.model import CacheStep
    args = DecoderArgs()
    model = random_decoder(args, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([1000, 937, 64, 1], device="cuda")
    embeds = torch.randn(4, 1000, args.hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(3, 1000, (4, 1), device="cuda")
    out = {}
    for kernel in ("torch", "triton"):
        model.use_rope_kernel(kernel)
        cache = KVCache(args.n_layers, args.n_heads, args.head_dim, 80, 4, 1024, "cuda", cache_dtype)
        for row, n in enumerate(lengths.tolist()):
            cache.reserve(row, n + 1)
        cache.sync()
        with torch.inference_mode():
            prefill = model(inputs_embeds=embeds, step=CacheStep(cache, slot=0), logits_at=lengths - 1)
            step = model(input_ids=ids, positions=lengths[:, None],
                         step=CacheStep(cache, positions=lengths, kv_len=1024))
        keep = torch.arange(cache.k.shape[1], device="cuda") != SCRATCH_PAGE
        out[kernel] = torch.cat([prefill.flatten(), step.flatten()]), cache.k[:, keep], cache.v[:, keep]
    model.use_rope_kernel()
    errs = {name: rel_err(fused.float(), ref.float())
            for name, ref, fused in zip(("logits", "k", "v"), out["torch"], out["triton"])}
    print(f"rope kernel vs reference ({cache_dtype}): " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    assert errs["logits"] <= 1e-2 and errs["k"] <= 1e-2 and errs["v"] <= 1e-2


def test_prefill_attention_never_runs_cudnn(pair, monkeypatch):
    """Prefills run SDPA with cuDNN's backend off (it plans each new sequence length on first
    sight: a fresh node's first page waited 629 ms on it); decode steps use the paged kernel."""
    import torch.nn.functional as F
    from decoder import model as model_module
    ours, _ = pair
    seen, sdpa = [], F.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", recording_sdpa)
    with torch.no_grad():
        ours(input_ids=torch.tensor([[5, 6, 7, 8]]))
    assert seen and not any(seen) and torch.backends.cuda.cudnn_sdp_enabled()

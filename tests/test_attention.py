"""The fused rel-pos attention against the dense-bias reference and a float64 formula."""

import pytest
import torch

from encoder import EncoderArgs
from encoder.model import SamBlock
from encoder.relpos_attention import (blocked_relpos_attention, dense_relpos_attention, fused_relpos_attention,
                                      get_rel_pos, rel_pos_terms, relpos_attention)
from tests.conftest import run_in_triton_interpreter
from tests.helpers import rel_err

# (grid, table rows): 64x64 global block on a 1024 view, 40x40 global block on a 640 crop
# (table interpolated), 14x14 window, and an 80x80 global block (1280 "large" mode).
SHAPES = [((64, 64), 127), ((40, 40), 127), ((14, 14), 27), ((80, 80), 127)]


def inputs(bsz, hw, rows, heads=2, dim=64, seed=0, device="cpu", dtype=torch.float32):
    """q, k, v [B, n, HW, C] as the model makes them (strided views of one qkv projection)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(bsz, hw[0] * hw[1], 3, heads, dim, generator=gen).to(device, dtype)
    tables = [0.1 * torch.randn(rows, dim, generator=gen).to(device, dtype) for _ in range(2)]
    return [*qkv.permute(2, 0, 3, 1, 4).unbind(0), *tables]


def formula(q, k, v, rel_pos_h, rel_pos_w, hw, rows_per_chunk=1024):
    """Softmax(scale q.k + rel_h[kh] + rel_w[kw]) v, spelled out in float64, `rows_per_chunk`
    query rows at a time (the GPU test's largest case: 29 GB of float64 logits in one piece)."""
    q, k, v = q.double(), k.double(), v.double()
    rh, rw = get_rel_pos(hw[0], rel_pos_h.double()), get_rel_pos(hw[1], rel_pos_w.double())
    bsz, n, tokens, c = q.shape
    rh_per_row = rh.repeat_interleave(hw[1], dim=0)  # query row i = (i // w, i % w)
    rw_per_row = rw.repeat(hw[0], 1, 1)
    out = []
    for start in range(0, tokens, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        qc = q[:, :, rows]
        bias = (torch.einsum("bnic,ikc->bnik", qc, rh_per_row[rows])[..., :, None]
                + torch.einsum("bnic,ikc->bnik", qc, rw_per_row[rows])[..., None, :])
        logits = qc @ k.transpose(-1, -2) * c ** -0.5 + bias.reshape(bsz, n, qc.shape[2], -1)
        out.append(logits.softmax(-1) @ v)
    return torch.cat(out, dim=2)


@pytest.mark.parametrize("bsz", [1, 2])
@pytest.mark.parametrize("hw, rows", SHAPES)
def test_fused_equals_dense_fp32(bsz, hw, rows):
    q, k, v, rph, rpw = inputs(bsz, hw, rows, seed=bsz)
    rel_h, rel_w = rel_pos_terms(q, rph, rpw, hw)
    dense = dense_relpos_attention(q, k, v, rel_h, rel_w)
    fused = fused_relpos_attention(q, k, v, rel_h, rel_w)
    assert fused.shape == dense.shape == q.shape
    assert rel_err(fused, dense) <= 1e-5
    assert rel_err(dense, formula(q, k, v, rph, rpw, hw)) <= 1e-5


@pytest.mark.parametrize("rows_per_block", [1, 333, 1000])
def test_blocks_of_queries_equal_the_whole_dense_bias(rows_per_block):
    """The CPU's way (`fused` there): the bias made `rows_per_block` query rows at a time, the
    last block short, equals the whole dense bias's result."""
    q, k, v, rph, rpw = inputs(2, (40, 40), 127, seed=3)
    rel_h, rel_w = rel_pos_terms(q, rph, rpw, (40, 40))
    row_bytes = 2 * 1600 * 4  # heads x keys x fp32 (an image's: the blocks do not depend on the batch)
    blocked = blocked_relpos_attention(q, k, v, rel_h, rel_w, block_bytes=rows_per_block * row_bytes)
    assert rel_err(blocked, dense_relpos_attention(q, k, v, rel_h, rel_w)) <= 1e-6
    for i in range(2):  # each image's result the same to the bit alone as batched (its blocks its own)
        alone = [t[i:i + 1] for t in (q, k, v, rel_h, rel_w)]
        assert torch.equal(blocked_relpos_attention(*alone, block_bytes=rows_per_block * row_bytes), blocked[i:i + 1])


def test_rel_pos_changes_the_result():
    # Guards the test above against a rel-pos term that is silently dropped.
    q, k, v, rph, rpw = inputs(1, (14, 14), 27)
    with_rel = relpos_attention(q, k, v, rph, rpw, (14, 14))
    without = relpos_attention(q, k, v, torch.zeros_like(rph), torch.zeros_like(rpw), (14, 14))
    assert rel_err(with_rel, without) > 1e-2


def test_get_rel_pos_interpolates_linearly():
    table = torch.arange(5.0)[:, None].repeat(1, 3)  # 5 rows = a grid of 3
    assert torch.equal(get_rel_pos(3, table)[:, :, 0], torch.tensor([[2., 1, 0], [3, 2, 1], [4, 3, 2]]))
    wider = get_rel_pos(4, table)  # 7 rows interpolated from 5: still monotone, same ends
    diag = wider[:, 0, 0]
    assert torch.all(diag[1:] > diag[:-1]) and wider[0, 3, 0] == 0.0 and wider[3, 0, 0] == 4.0


@pytest.mark.parametrize("window", [14, 0], ids=["windowed", "global"])
@pytest.mark.parametrize("grid", [64, 40])
def test_sam_block_fused_equals_dense(window, grid):
    args = EncoderArgs(sam_width=128, sam_heads=2)
    torch.manual_seed(grid + window)
    block = SamBlock(args, window)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
        x = torch.randn(1, grid, grid, 128)
        block.attn.impl = "dense"
        dense = block(x)
        block.attn.impl = "fused"
        fused = block(x)
    assert rel_err(fused, dense) <= 1e-5


INTERPRET_SCRIPT = """
import torch
from encoder.relpos_attention import dense_relpos_attention, rel_pos_terms, rel_table
from encoder import triton_relpos
from encoder.triton_relpos import relpos_attention, relpos_attention_triton
from tests.test_attention import inputs
SPLITS = {(40, 40): [dict(BLOCK_M=64, ROWS=2, ROW_PAD=64), dict(BLOCK_M=64, ROWS=4, ROW_PAD=32, TAIL_ROWS=16)],
          (5, 9): [dict(BLOCK_M=64, ROWS=2, ROW_PAD=8, TAIL_ROWS=16)]}
for hw, rows, bsz in [((14, 14), 27, 2), ((40, 40), 127, 1), ((5, 9), 27, 1), ((8, 8), 27, 1),
                      ((16, 16), 27, 1)]:
    q, k, v, rph, rpw = inputs(bsz, hw, rows, seed=7)
    rel_h, rel_w = rel_pos_terms(q, rph, rpw, hw)
    # The rel-terms kernel against the einsums, q strided as the projection leaves it.
    kernel_h, kernel_w = triton_relpos.rel_pos_terms(q, rel_table(hw[0], rph), rel_table(hw[1], rpw), hw)
    for got, want in ((kernel_h, rel_h), (kernel_w, rel_w)):
        assert got.shape == want.shape and ((got - want).norm() / want.norm()).item() <= 1e-5, hw
    ref = dense_relpos_attention(q, k, v, rel_h, rel_w)
    out = relpos_attention(q, k, v, rel_h, rel_w)
    if bsz == 2:  # the custom op (torch.compile's entry) launches the same kernel
        assert torch.equal(relpos_attention_triton(q, k, v, rel_h, rel_w), out)
    err = ((out - ref).norm() / ref.norm()).item()
    assert out.shape == ref.shape and out.transpose(1, 2).is_contiguous(), (out.shape, out.stride())
    assert err <= 1e-5, (hw, err)
    # Other tile configs than the tuned one: each row padded to a power of two in one part, or
    # split in two parts (the tail's columns and rows masked where they overhang).
    for tiles in SPLITS.get(hw, []):
        out = triton_relpos.launch(q, k, v, rel_h, rel_w, triton_relpos._empty_output(q),
                                   num_warps=4, num_stages=2, **tiles)
        err = ((out - ref).norm() / ref.norm()).item()
        assert err <= 1e-5, (hw, tiles, err)
print("interpreted kernel ok")
"""


WINDOWS_SCRIPT = """
import torch
from encoder import triton_relpos
from encoder.model import SamAttention, window_partition, window_unpartition
from encoder.relpos_attention import windowed_relpos_attention
torch.manual_seed(3)
attn = SamAttention(64, 2, 14)
for p in attn.parameters():
    torch.nn.init.normal_(p, std=0.2)
attn.impl = "dense"
for grid in [(20, 23), (28, 14), (9, 30)]:  # windows over the edge (padded), exact, one row
    x = torch.randn(2, *grid, 64)
    windows, padded = window_partition(x, 14)
    ref = window_unpartition(attn(windows), 14, padded, grid)
    qkv = attn.qkv(x).reshape(2, grid[0] * grid[1], 3, 2, 32)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    # The tuned tiles, and the windows split in two parts (8 columns, then the last 6 padded
    # to 8, rows past 14 masked).
    tuned = triton_relpos.TUNED[14]
    split = dict(BLOCK_M=64, ROWS=16, ROW_PAD=8, TAIL_ROWS=16, num_warps=4, num_stages=2)
    for tiles in (tuned, split):
        triton_relpos.TUNED[14] = tiles
        out = windowed_relpos_attention(q, k, v, attn.rel_pos_h, attn.rel_pos_w, 14, grid, attn.qkv.bias)
        fast = attn.proj(out.transpose(1, 2).reshape(2, *grid, 64))
        err = ((fast - ref).norm() / ref.norm()).item()
        assert err <= 1e-5, (grid, tiles, err)
    triton_relpos.TUNED[14] = tuned
print("windows in place ok")
"""


NORM_SCRIPT = """
import torch
from encoder.triton_norm import layer_norm
torch.manual_seed(0)
for rows, width in [(37, 768), (5, 1024), (3, 100)]:
    norm = torch.nn.LayerNorm(width, eps=1e-6)
    torch.nn.init.normal_(norm.weight), torch.nn.init.normal_(norm.bias)
    x, h = torch.randn(2, rows, width), torch.randn(2, rows, width)
    with torch.no_grad():
        y = layer_norm(x, norm.weight, norm.bias, norm.eps)
        total, y2 = layer_norm(x, norm.weight, norm.bias, norm.eps, residual=h)
        assert torch.allclose(y, norm(x), atol=1e-5), (rows, width)
        assert torch.equal(total, x + h) and torch.allclose(y2, norm(x + h), atol=1e-5)
        shift = torch.randn(width)
        total3, y3 = layer_norm(x, norm.weight, norm.bias, norm.eps, residual=h, shift=shift)
        assert torch.equal(total3, x + h + shift) and torch.equal(y3, y2)
print("norm kernel ok")
"""


RESIDUAL_EPILOGUE_SCRIPT = """
import torch
from encoder import EncoderArgs, model
model._takes = lambda x, flag: flag  # the GPU's kernels, here in Triton's interpreter on CPU
torch.manual_seed(0)
args = EncoderArgs.tiny()
for layer, shape in ((model.SamBlock(args, 0), (2, 4, 4, args.sam_width)),
                     (model.ClipLayer(args), (2, 5, args.clip_width))):
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    x = torch.randn(shape)
    with torch.no_grad():
        model.RESIDUAL_EPILOGUE = True
        fused = layer(x)
        model.RESIDUAL_EPILOGUE = False
        reference = layer(x)
    assert torch.allclose(fused, reference, atol=1e-5), (type(layer), (fused - reference).abs().max())
print("residual epilogue ok")
"""


PATCHES_SCRIPT = """
import torch
from encoder.preprocess import normalize
from encoder.triton_pixels import normalized_patches
torch.manual_seed(0)
pixels = torch.randint(0, 256, (2, 3, 48, 48), dtype=torch.uint8)
got = normalized_patches(pixels, 16, torch.float32)
want = normalize(pixels).reshape(2, 3, 3, 16, 3, 16).permute(0, 2, 4, 1, 3, 5).reshape(2, 3, 3, 768)
assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-6)
print("patch kernel ok")
"""


QUICK_GELU_SCRIPT = """
import torch
from encoder.triton_activation import quick_gelu
torch.manual_seed(0)
x = 4 * torch.randn(3, 5000)  # over one program's block, a ragged tail
assert torch.allclose(quick_gelu(x), x * torch.sigmoid(1.702 * x), rtol=1e-6, atol=1e-6)
print("quick_gelu kernel ok")
"""


def test_quick_gelu_kernel_equals_torch_in_interpreter_mode():
    pytest.importorskip("triton")
    assert "quick_gelu kernel ok" in run_in_triton_interpreter(QUICK_GELU_SCRIPT)


def test_norm_kernel_equals_torch_in_interpreter_mode():
    pytest.importorskip("triton")
    assert "norm kernel ok" in run_in_triton_interpreter(NORM_SCRIPT)


def test_residual_epilogue_equals_the_add_in_interpreter_mode():
    """A SAM block and a CLIP layer with the residual add done by the MLP's second matmul (the
    shifted residual from the norm kernel, accumulated into in place) against the separate add."""
    pytest.importorskip("triton")
    assert "residual epilogue ok" in run_in_triton_interpreter(RESIDUAL_EPILOGUE_SCRIPT)


def test_patch_kernel_equals_normalize_and_unfold_in_interpreter_mode():
    pytest.importorskip("triton")
    assert "patch kernel ok" in run_in_triton_interpreter(PATCHES_SCRIPT)


def test_windows_in_place_equal_padded_partitions_in_interpreter_mode():
    """SAM's windows addressed in place by the kernels (zero padding as the projection's bias)
    against the reference: pad, partition, attention per window (dense bias), unpartition."""
    pytest.importorskip("triton")
    assert "windows in place ok" in run_in_triton_interpreter(WINDOWS_SCRIPT)


def test_triton_kernel_in_interpreter_mode():
    """The Triton kernel's logic on CPU (Triton's interpreter; fp32, exact dots)."""
    pytest.importorskip("triton")
    assert "interpreted kernel ok" in run_in_triton_interpreter(INTERPRET_SCRIPT)


@pytest.mark.gpu
@pytest.mark.parametrize("bsz", [1, 8])
@pytest.mark.parametrize("hw, rows", SHAPES)
def test_fused_paths_bf16_cuda(bsz, hw, rows):
    from encoder.relpos_attention import supports
    q, k, v, rph, rpw = inputs(bsz, hw, rows, heads=12, device="cuda", dtype=torch.bfloat16)
    assert supports(q, *rel_pos_terms(q, rph, rpw, hw)) and not q.is_contiguous()
    exact = formula(q, k, v, rph, rpw, hw)
    dense = relpos_attention(q, k, v, rph, rpw, hw, "dense")
    for impl in ("fused", "augmented"):  # fused = the Triton kernel here
        out = relpos_attention(q, k, v, rph, rpw, hw, impl)
        # bf16 inputs: within bf16 rounding of the float64 formula, and of the dense path.
        assert rel_err(out, exact) <= 1e-2, impl
        torch.testing.assert_close(out, dense, rtol=0.016, atol=0.016)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [14, 0], ids=["windowed", "global"])
@pytest.mark.parametrize("grid", [64, 40])
def test_sam_block_kernels_equal_the_reference_paths_on_gpu(window, grid, monkeypatch):
    """A real-width SAM block in bf16: the Triton path (windows addressed in place, rel terms
    from their kernel, the norm kernel, the GELU epilogue) against the reference's padded
    partitions, einsums, dense bias, torch's norms and exact GELU."""
    from encoder import model
    from encoder import relpos_attention as attention
    torch.manual_seed(grid + window)
    block = SamBlock(EncoderArgs(), window).cuda()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
        block.to(torch.bfloat16)
        x = torch.randn(4, grid, grid, 768, device="cuda", dtype=torch.bfloat16)
        fused = block(x)
        monkeypatch.setattr(attention, "WINDOWS_IN_KERNEL", False)
        monkeypatch.setattr(model, "NORM_KERNEL", False)
        monkeypatch.setattr(model, "GELU_EPILOGUE", False)
        block.attn.impl = "dense"
        dense = block(x)
    assert rel_err(fused, dense) <= 1e-2
    torch.testing.assert_close(fused, dense, rtol=0.02, atol=0.02)


@pytest.mark.gpu
def test_quick_gelu_kernel_is_torch_bit_for_bit_on_gpu(monkeypatch):
    """bf16, CLIP's MLP width: one pass, the same roundings and ops as torch's three kernels;
    a CLIP MLP the same with the kernel switched off (DEEPSEEK_OCR_ACTIVATION_KERNEL=0)."""
    from encoder import model
    from encoder.triton_activation import quick_gelu
    torch.manual_seed(1)
    x = 3 * torch.randn(4099, 4096, device="cuda", dtype=torch.bfloat16)
    want, got = x * torch.sigmoid(1.702 * x), quick_gelu(x)
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {x.numel()} differ"
    mlp = model.ClipMLP(1024, 4096).cuda().to(torch.bfloat16)
    h = torch.randn(2, 101, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        fast = mlp(h)
        monkeypatch.setattr(model, "ACTIVATION_KERNEL", False)
        assert torch.equal(fast, mlp(h))


@pytest.mark.gpu
@pytest.mark.parametrize("hw, rows", SHAPES)
def test_rel_terms_kernel_equals_the_einsums_on_gpu(hw, rows):
    """The fused path's rel terms (one Triton kernel) against the reference einsums, bf16: the
    same products, summed in fp32 and rounded once in both."""
    from encoder import triton_relpos
    from encoder.relpos_attention import rel_table
    q, k, v, rph, rpw = inputs(8, hw, rows, heads=12, device="cuda", dtype=torch.bfloat16)
    want = rel_pos_terms(q, rph, rpw, hw)
    got = triton_relpos.rel_pos_terms(q, rel_table(hw[0], rph), rel_table(hw[1], rpw), hw)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0.016, atol=0.016)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [4096, 6 * 1600])
def test_gelu_epilogue_equals_linear_and_gelu_on_gpu(tokens, monkeypatch):
    """SAM's lin1 + GELU as one cuBLASLt matmul (bias + GELU epilogue) in bf16: GELU's tanh form
    within bf16 rounding of linear + F.gelu(approximate="tanh"), and no further from an fp32
    run of the exact GELU than the two bf16 ops; a SAM MLP with it switched off is the two ops."""
    from encoder import model
    torch.manual_seed(tokens)
    lin = torch.nn.Linear(768, 3072).cuda()
    with torch.no_grad():
        lin.weight.normal_(0, 0.04), lin.bias.normal_(0, 0.04)
        x = torch.randn(2, tokens // 2, 768, device="cuda")
        exact = torch.nn.functional.gelu(lin(x))
        lin.to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        fused = model.linear_gelu(lin, xb)
        two_ops = torch.nn.functional.gelu(lin(xb))
        torch.testing.assert_close(fused, torch.nn.functional.gelu(lin(xb), approximate="tanh"),
                                   rtol=0.016, atol=0.016)
        assert fused.shape == two_ops.shape == (2, tokens // 2, 3072)
        assert rel_err(fused, exact) <= 1.1 * rel_err(two_ops, exact)
        monkeypatch.setattr(model, "GELU_EPILOGUE", False)
        assert torch.equal(model.linear_gelu(lin, xb), two_ops)


@pytest.mark.gpu
@pytest.mark.parametrize("layer", ["sam", "clip"])
def test_residual_epilogue_on_gpu(layer, monkeypatch):
    """bf16 at real widths (a SAM global block on a crop's 40x40 grid, a CLIP layer on 6 crops'
    tokens): the residual add inside the MLP's second matmul within bf16 rounding of the
    separate add. Against an fp32 run of the same weights it may be up to ~1.4x as far: the
    stream plus the bias is rounded at the stream's scale before the products are added, where
    the separate add rounds the MLP's output at its own (smaller) scale; a CPU simulation of the
    two roundings gives 0.77-1.32x. The whole encoder's bound against fp32 is test_model's."""
    from encoder import model
    torch.manual_seed(7)
    args = EncoderArgs()
    block = model.SamBlock(args, 0) if layer == "sam" else model.ClipLayer(args)
    block = block.cuda()
    shape = (6, 40, 40, args.sam_width) if layer == "sam" else (6, 101, args.clip_width)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
        x = torch.randn(shape, device="cuda")
        exact = block(x)
        block.to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        fused = block(xb)
        monkeypatch.setattr(model, "RESIDUAL_EPILOGUE", False)
        reference = block(xb)
    assert not torch.equal(fused, reference)  # the epilogue really ran
    torch.testing.assert_close(fused, reference, rtol=0.02, atol=0.02)
    print(f"{layer}: residual epilogue vs fp32 {rel_err(fused, exact):.2e}, "
          f"separate add vs fp32 {rel_err(reference, exact):.2e}")
    assert rel_err(fused, exact) <= 1.5 * rel_err(reference, exact)


@pytest.mark.gpu
@pytest.mark.parametrize("views, size", [(6, 640), (2, 1024)])
def test_patch_kernel_is_torch_bit_for_bit_on_gpu(views, size, monkeypatch):
    """The pixels normalised and unfolded in one pass equal torch's normalize, cast and unfold
    bit for bit, and so does the patch embedding fed uint8 (off: torch's ops)."""
    from encoder import model
    from encoder.preprocess import normalize
    from encoder.triton_pixels import normalized_patches
    torch.manual_seed(size)
    pixels = torch.randint(0, 256, (views, 3, size, size), dtype=torch.uint8, device="cuda")
    g = size // 16
    want = (normalize(pixels).to(torch.bfloat16).reshape(views, 3, g, 16, g, 16)
            .permute(0, 2, 4, 1, 3, 5).reshape(views, g, g, 768))
    assert torch.equal(normalized_patches(pixels, 16, torch.bfloat16), want)
    embed = model.PatchEmbed(16, 768).cuda().to(torch.bfloat16)
    with torch.no_grad():
        assert model.patch_kernel_takes(pixels, torch.bfloat16)
        assert torch.equal(embed(pixels), embed(normalize(pixels).to(torch.bfloat16)))
        monkeypatch.setattr(model, "PATCH_KERNEL", False)
        assert not model.patch_kernel_takes(pixels, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [768, 1024, 256])
def test_norm_kernel_equals_torch_on_gpu(width):
    """bf16: the residual sum bit for bit the separate add's, the norm within one rounding."""
    from encoder.triton_norm import layer_norm
    torch.manual_seed(width)
    norm = torch.nn.LayerNorm(width, eps=1e-6).cuda()
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
        norm.to(torch.bfloat16)
        x, h = (torch.randn(8, 4096, width, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        total, y = layer_norm(x, norm.weight, norm.bias, norm.eps, residual=h)
        assert torch.equal(total, x + h)
        torch.testing.assert_close(y, norm(x + h), rtol=0.016, atol=0.016)
        torch.testing.assert_close(layer_norm(x, norm.weight, norm.bias, norm.eps), norm(x),
                                   rtol=0.016, atol=0.016)


FORWARD_WITHOUT_THE_COMPILER = """
import sys
import torch
from encoder import EncoderArgs
from encoder.checkpoint import random_encoder
from encoder.relpos_attention import supports
enc = random_encoder(EncoderArgs(), device="cuda", dtype=torch.bfloat16)
with torch.inference_mode():
    enc.forward_global(torch.zeros(1, 3, 1024, 1024, dtype=torch.uint8, device="cuda"))
    enc.forward_local(torch.zeros(1, 3, 640, 640, dtype=torch.uint8, device="cuda"))
q = torch.zeros(1, 1, 16, 64, device="cuda", dtype=torch.bfloat16)
print(supports(q, q[..., :4], q[..., :4]), "torch._dynamo" in sys.modules)
"""


@pytest.mark.gpu
def test_eager_forwards_launch_the_kernel_without_importing_the_compiler():
    """The Triton kernel launches directly outside torch.compile: a custom op's first call
    imports torch._dynamo (~900 modules, seconds of an encoder replica's start-up)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", FORWARD_WITHOUT_THE_COMPILER],
                         env=dict(os.environ, PYTHONPATH=root), cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", "False"], run.stdout


@pytest.mark.gpu
def test_triton_kernel_replays_in_a_cuda_graph():
    q, k, v, rph, rpw = inputs(2, (40, 40), 127, heads=12, device="cuda", dtype=torch.bfloat16)
    eager = relpos_attention(q, k, v, rph, rpw, (40, 40))
    from encoder.graphs import capture_graph
    graph, out = capture_graph(lambda: relpos_attention(q, k, v, rph, rpw, (40, 40)))
    graph.replay()
    assert torch.equal(out, eager)


@pytest.mark.gpu
def test_triton_kernel_traces_under_torch_compile():
    q, k, v, rph, rpw = inputs(1, (14, 14), 27, heads=12, device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(lambda *a: relpos_attention(*a, (14, 14)), fullgraph=True)
    torch.testing.assert_close(fn(q, k, v, rph, rpw), relpos_attention(q, k, v, rph, rpw, (14, 14)),
                               rtol=0.016, atol=0.016)


def test_kernel_choices_trace_under_torch_compile_fullgraph():
    """The helpers that pick the Triton kernels stay traceable by torch.compile with
    fullgraph=True (an importlib call in them broke the compiled encoder on the GPU)."""
    from encoder import model
    from encoder import relpos_attention as attention

    def choose(x):
        return x + (attention._triton() is not None) + (model._pointwise_kernels() is not None)

    x = torch.zeros(2)
    assert torch.equal(torch.compile(choose, fullgraph=True, backend="eager")(x), choose(x))


class _RecordingKernel:
    """Stands in for a Triton kernel: records launches (`kernel[grid](...)`) and compiles
    (`kernel.warmup(...)`)."""

    def __init__(self):
        self.launches, self.compiles = [], []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.compiles.append((grid, args, kwargs))


def test_compile_ahead_compiles_instead_of_launching_then_launches_again(monkeypatch):
    """Inside `compile_ahead` a launch through `launch_kernel` only compiles (Triton's warmup,
    with the launch's own arguments, so the same specialisation); after it, launches run. The
    switch off: the forward does not run at all."""
    pytest.importorskip("triton.runtime._async_compile")
    from common.triton_compile import compile_ahead, launch_kernel
    kernel = _RecordingKernel()
    monkeypatch.delenv("DEEPSEEK_OCR_COMPILE_AHEAD", raising=False)
    seconds = compile_ahead(lambda: launch_kernel(kernel, (4, 2), "q", 7, BLOCK=64))
    assert seconds > 0 and kernel.launches == []
    assert kernel.compiles == [((4, 2), ("q", 7), {"BLOCK": 64})]
    launch_kernel(kernel, (1,), "x")
    assert kernel.launches == [((1,), ("x",), {})]
    monkeypatch.setenv("DEEPSEEK_OCR_COMPILE_AHEAD", "0")
    assert compile_ahead(lambda: pytest.fail("the forward ran with the switch off")) == 0.0

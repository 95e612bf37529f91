"""DeepEncoder V2 (DeepSeek-OCR-2's vision encoder) against transformers' `deepseek_ocr2`, both
loaded from one random checkpoint in the released layout (fp32); its attention pattern; its
token counts; its real dims, built on the meta device (no memory)."""
import pytest
import torch

from common.checkpoint import meta_module
from encoder import DeepEncoderV2, EncoderV2Args, load_encoder, random_encoder, write_random_checkpoint
from encoder.checkpoint import vision_shapes
from encoder.qwen2_model import causal_flow_mask
from encoder.views import normalize
from tests import reference_ocr2 as ref
from tests.conftest import run_in_triton_interpreter
from tests.helpers import rel_err
from tests.test_ocr2_tiling import noise, preprocess_ocr2

# Real head dims (SAM 64, Qwen2 64) and grouped key/value heads (2, as the release), reduced
# widths and depths; SAM's global blocks 1 and 3 run on a 48x48 grid for a crop (rel-pos tables
# interpolated from 127 to 95 rows, pos_embed from 64x64 to 48x48).
REF_ARGS = EncoderV2Args(sam_width=128, sam_depth=4, sam_heads=2, sam_global_blocks=(1, 3),
                         sam_out_chans=32, downsample_channels=(64, 256), qwen2_width=256,
                         qwen2_depth=2, qwen2_heads=4, qwen2_kv_heads=2, qwen2_mlp_dim=512,
                         n_embed=96, name="reference-test")
PAGE, SMALL = (1191, 1684), (500, 300)  # a tiled A4 page at 144 dpi (2 x 3 crops), an untiled image


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    """Both encoders' outputs for a page and a small image (one checkpoint, the same pixels)."""
    path = write_random_checkpoint(tmp_path_factory.mktemp("ocr2-ref"), REF_ARGS, seed=1,
                                   dtype=torch.float32)
    ours = load_encoder(path)  # config.json is DeepSeek-OCR-2's: load_encoder gives V2
    theirs = ref.deepseek_ocr2_model(path, REF_ARGS, tmp_path_factory.mktemp("ocr2-hf"))
    items = [preprocess_ocr2(noise(*PAGE, seed=1)), preprocess_ocr2(noise(*SMALL, seed=2))]
    global_views = torch.stack([it.global_view for it in items])
    crops = torch.cat([it.crops for it in items])
    with torch.inference_mode():
        ours_global, ours_local = ours.forward_global(global_views), ours.forward_local(crops)
        image = theirs.get_image_features(normalize(global_views), normalize(crops),
                                          [it.crops.shape[0] for it in items], return_dict=True)
        theirs_global = theirs.multi_modal_projector(image.last_hidden_state)
        theirs_local = theirs.multi_modal_projector(image.local_last_hidden_state)
        ours_sequences = [ours.sequence(ours_global[0], ours_local, items[0].grid),
                          ours.sequence(ours_global[1], ours_local[:0], items[1].grid)]
    return dict(ours=ours, items=items, ours_global=ours_global, ours_local=ours_local,
                theirs_global=theirs_global, theirs_local=theirs_local,
                ours_sequences=ours_sequences, theirs_sequences=image.pooler_output)


def test_global_view_tokens_match_transformers(encoded):
    ours, theirs = encoded["ours_global"], encoded["theirs_global"]
    assert isinstance(encoded["ours"], DeepEncoderV2)
    assert ours.shape == theirs.shape == (2, 256, REF_ARGS.n_embed)
    assert rel_err(ours, theirs) <= 1e-4


def test_crop_tokens_match_transformers(encoded):
    ours, theirs = encoded["ours_local"], encoded["theirs_local"]
    assert ours.shape == theirs.shape == (6, 144, REF_ARGS.n_embed)
    assert rel_err(ours, theirs) <= 1e-4


def test_assembled_sequences_match_transformers(encoded):
    """Crops' tokens (row-major), the global view's, the view separator; no newlines."""
    page, small = encoded["items"]
    assert (page.grid, small.grid) == ((2, 3), (1, 1))
    for item, ours, theirs in zip(encoded["items"], encoded["ours_sequences"],
                                  encoded["theirs_sequences"]):
        crops = item.crops.shape[0]
        assert ours.shape == theirs.shape == (144 * crops + 256 + 1, REF_ARGS.n_embed)
        assert ours.shape[0] == item.num_tokens
        assert rel_err(ours, theirs) <= 1e-4
    page_sequence = encoded["ours_sequences"][0]
    assert torch.equal(page_sequence[:144], encoded["ours_local"][0])  # the top-left crop first
    assert torch.equal(page_sequence[5 * 144:6 * 144], encoded["ours_local"][5])
    assert torch.equal(page_sequence[6 * 144:-1], encoded["ours_global"][0])
    assert torch.equal(page_sequence[-1], encoded["ours"].view_seperator)


def test_causal_flow_mask():
    """Image tokens see image tokens only; a query sees every image token and the queries up
    to itself. Made once per view size (a CUDA graph reads it where it is)."""
    allowed = torch.tensor([[1, 1, 1, 0, 0, 0],
                            [1, 1, 1, 0, 0, 0],
                            [1, 1, 1, 0, 0, 0],
                            [1, 1, 1, 1, 0, 0],
                            [1, 1, 1, 1, 1, 0],
                            [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_flow_mask(3, 3, torch.device("cpu")), allowed)
    for n in (144, 256):  # DeepSeek's own mask, at both view sizes
        token_type_ids = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.long)])
        assert torch.equal(causal_flow_mask(n, n, torch.device("cpu")), ref.deepseek_mask(token_type_ids) == 0)
    assert causal_flow_mask(256, 256, torch.device("cpu")) is causal_flow_mask(256, 256, torch.device("cpu"))


def test_queries_flow_causally():
    """Changing query k leaves the outputs of queries 0..k-1 exactly as they were."""
    encoder = random_encoder(EncoderV2Args.tiny(), seed=2)
    qwen2 = encoder.qwen2_model
    features = torch.randn(2, EncoderV2Args.tiny().qwen2_width, 12, 12,
                           generator=torch.Generator().manual_seed(0))  # a crop's SAM output
    k = 100
    with torch.inference_mode():
        before = qwen2(features)
        qwen2.query_768.weight[k] += 1.0
        after = qwen2(features)
        qwen2.query_768.weight[k] -= 1.0
    assert before.shape == (2, 144, EncoderV2Args.tiny().qwen2_width)
    assert torch.equal(before[:, :k], after[:, :k])
    assert not torch.allclose(before[:, k:], after[:, k:])


def test_view_of_another_size_has_no_queries():
    encoder = random_encoder(EncoderV2Args.tiny())
    with torch.inference_mode(), pytest.raises(ValueError, match="no learned queries for a view of 100"):
        encoder.forward_local(torch.zeros(1, 3, 640, 640, dtype=torch.uint8))


def test_real_dims_on_the_meta_device():
    """The full-size encoder, built and run without memory: token counts of both paths and of
    a 2 x 3 page, and the shapes DeepSeek-OCR-2's code gives its weights."""
    encoder = meta_module(lambda: DeepEncoderV2(EncoderV2Args()))
    with torch.inference_mode():
        global_tokens = encoder.forward_global(torch.zeros(2, 3, 1024, 1024, dtype=torch.uint8,
                                                           device="meta"))
        crop_tokens = encoder.forward_local(torch.zeros(6, 3, 768, 768, dtype=torch.uint8,
                                                        device="meta"))
    assert global_tokens.shape == (2, 256, 1280) and crop_tokens.shape == (6, 144, 1280)
    assert encoder.sequence(global_tokens[0], crop_tokens, (2, 3)).shape == (6 * 144 + 256 + 1, 1280)
    assert encoder.sequence(global_tokens[0], crop_tokens[:0], (1, 1)).shape == (257, 1280)

    shapes = vision_shapes(EncoderV2Args())
    layer = "model.qwen2_model.model.model.layers.23."
    expected = {  # deepencoderv2/{sam_vary_sdpa,qwen2_d2e}.py, deepseek_ocr2.py
        "model.sam_model.patch_embed.proj.weight": (768, 3, 16, 16),
        "model.sam_model.pos_embed": (1, 64, 64, 768),
        "model.sam_model.blocks.2.attn.rel_pos_h": (127, 64),  # global block
        "model.sam_model.blocks.3.attn.rel_pos_w": (27, 64),  # 14x14 windows
        "model.sam_model.net_2.weight": (512, 256, 3, 3),
        "model.sam_model.net_3.weight": (896, 512, 3, 3),  # not 1024 as DeepSeek-OCR's
        "model.qwen2_model.query_768.weight": (144, 896),
        "model.qwen2_model.query_1024.weight": (256, 896),
        layer + "self_attn.q_proj.weight": (896, 896), layer + "self_attn.q_proj.bias": (896,),
        layer + "self_attn.k_proj.weight": (128, 896), layer + "self_attn.k_proj.bias": (128,),
        layer + "self_attn.v_proj.weight": (128, 896), layer + "self_attn.o_proj.weight": (896, 896),
        layer + "mlp.gate_proj.weight": (4864, 896), layer + "mlp.up_proj.weight": (4864, 896),
        layer + "mlp.down_proj.weight": (896, 4864),
        layer + "input_layernorm.weight": (896,), layer + "post_attention_layernorm.weight": (896,),
        "model.qwen2_model.model.model.norm.weight": (896,),
        "model.projector.layers.weight": (1280, 896), "model.projector.layers.bias": (1280,),
        "model.view_seperator": (1280,),
    }
    assert {k: tuple(shapes[k]) for k in expected} == expected
    assert not any(k.startswith(("model.vision_model.", "model.image_newline")) for k in shapes)
    assert not any(".layers.24." in k or ".blocks.12." in k or k.endswith(".o_proj.bias") for k in shapes)
    assert len(shapes) == 473  # SAM 164 + Qwen2 24 * 12 + 1 + queries 2 + projector 2 + separator
    params = {prefix: sum(s.numel() for k, s in shapes.items() if k.startswith(prefix))
              for prefix in ("model.sam_model.", "model.qwen2_model.", "model.projector.")}
    # Qwen2 per layer: q, k, v with biases (803,712 + 2 x 114,816), o 802,816, MLP 3 x 896 x
    # 4864, two norms: 14,912,384; x 24, the final norm, 400 queries x 896. SAM-B's ~89.7M plus
    # net_2 (1.18M) and net_3 (4.13M).
    assert params == {"model.sam_model.": 94_979_328, "model.qwen2_model.": 358_256_512,
                      "model.projector.": 1_148_160}


def test_real_dims_match_transformers_names_and_shapes():
    """Every key of ours at real dims, renamed by transformers' own map of the released layout
    (conversion_mapping "deepseek_ocr2"), is one of its DeepseekOcr2Model's, same shape, and
    every vision weight of its model is one of ours."""
    ref.deepseek_ocr2()
    from transformers import DeepseekOcr2ForConditionalGeneration
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    transforms = get_checkpoint_conversion_mapping("deepseek_ocr2")
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    with torch.device("meta"):
        theirs = DeepseekOcr2ForConditionalGeneration(ref.deepseek_ocr2_config(EncoderV2Args()))
    their_shapes = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    ours = {rename_source_key(k, renamings, converters)[0]: tuple(v)
            for k, v in vision_shapes(EncoderV2Args()).items()}
    assert {k: their_shapes.get(k) for k in ours} == ours
    their_vision = {k for k in their_shapes if not k.startswith(("model.language_model.", "lm_head."))}
    assert their_vision == set(ours)


@pytest.mark.parametrize("n_image", [144, 256])
def test_split_flow_attention_equals_the_masked_attention(n_image):
    """DEEPSEEK_OCR_SPLIT_FLOW_ATTENTION's two mask-free SDPAs (image rows; query rows causal
    lower-right) against the one masked SDPA (the reference), fp32, grouped heads repeated."""
    from encoder.qwen2_model import flow_attention
    gen = torch.Generator().manual_seed(n_image)
    q, k, v = (torch.randn(2, 14, 2 * n_image, 64, generator=gen) for _ in range(3))
    mask = causal_flow_mask(n_image, n_image, torch.device("cpu"))
    reference = flow_attention(q, k, v, mask, n_image, split=False)
    split = flow_attention(q, k, v, mask, n_image, split=True)
    assert rel_err(split, reference) < 1e-6


def test_encoder_with_split_flow_attention_equals_the_reference():
    encoder = random_encoder(EncoderV2Args.tiny(), seed=4)
    pixels = [torch.randint(0, 256, (2, 3, size, size), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(size)) for size in (1024, 768)]
    with torch.inference_mode():
        reference = [encoder.forward_global(pixels[0]), encoder.forward_local(pixels[1])]
        for layer in encoder.qwen2_model.model.model.layers:
            layer.self_attn.split_flow = True
        split = [encoder.forward_global(pixels[0]), encoder.forward_local(pixels[1])]
    for got, want in zip(split, reference):
        assert rel_err(got, want) < 1e-5


def test_packed_qkv_equals_the_released_projections():
    """The Qwen2 stage with q, k and v in one matmul of their stacked weights (the default)
    against the released three matmuls (`Qwen2Attention.fused = False`), fp32; the stack made
    again once a load has changed the weights."""
    from encoder.qwen2_model import Qwen2Encoder
    args = EncoderV2Args.tiny()
    encoder = Qwen2Encoder(args)
    features = torch.randn(2, args.qwen2_width, 12, 12, generator=torch.Generator().manual_seed(0))
    attention = encoder.model.model.layers[0].self_attn
    for seed in (1, 2):
        torch.manual_seed(seed)
        encoder.load_state_dict({k: torch.randn_like(v) * 0.2 for k, v in encoder.state_dict().items()})
        with torch.inference_mode():
            packed = encoder(features)
            stacked = attention.packed_qkv()[0]
            for layer in encoder.model.model.layers:
                layer.self_attn.fused = False
            released = encoder(features)
            for layer in encoder.model.model.layers:
                layer.self_attn.fused = True
        assert torch.equal(stacked[:attention.q_proj.out_features], attention.q_proj.weight)
        assert rel_err(packed, released) < 1e-6


QWEN2_KERNELS_IN_INTERPRETER = """
import torch
import torch.nn.functional as F
from encoder import EncoderV2Args, model
from encoder.qwen2_model import Qwen2Encoder, RMSNorm, apply_rope, rope_tables
from encoder.triton_activation import silu_mul
from encoder.triton_norm import rms_norm
from encoder.triton_rope import rope
torch.manual_seed(0)
# RoPE: bit for bit apply_rope on the head-major view (fp16; 14 heads: a partial power of two)
cos, sin = rope_tables(20, 64, 1e6, torch.device("cpu"), torch.float16)
for heads in (14, 2):
    x = torch.randn(3, 20, heads * 64).half()
    want = apply_rope(x.view(3, 20, heads, 64).transpose(1, 2), cos, sin)
    got = rope(x, cos, sin, 64).view(3, 20, heads, 64).transpose(1, 2)
    assert torch.equal(got, want), float((got.float() - want.float()).abs().max())
# bf16's rounding by the bits (the interpreter has no bf16 tensors: fp32 in, fp32 out), against
# torch's cast: ties to even both ways, signs, subnormals, the largest finite values and inf.
import triton
import triton.language as tl
from encoder.triton_rope import _rounded


@triton.jit
def _round_bf16(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, _rounded(tl.load(X + offs, mask=offs < n), tl.bfloat16), mask=offs < n)


ties = torch.tensor([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 2.0 ** -130 * 1.5])
values = torch.cat([ties, torch.randn(4000) * 10.0 ** torch.randint(-30, 30, (4000,)),
                    torch.tensor([3.3895e38, -3.3895e38, float("inf"), -float("inf"), 0.0, -0.0])])
rounded = torch.empty_like(values)
_round_bf16[(1,)](values, rounded, values.numel(), BLOCK=triton.next_power_of_2(values.numel()))
assert torch.equal(rounded, values.bfloat16().float())
# SiLU(gate) * up (the interpreter's exp is numpy's, not libdevice's: within a rounding)
gate, up = torch.randn(5, 4864).half(), torch.randn(5, 4864).half()
assert torch.allclose(silu_mul(gate, up).float(), (F.silu(gate.float()).half() * up).float(), rtol=2e-3, atol=2e-3)
# fp16 (the interpreter has no bf16): the sum as the separate add rounds it, the norm within
# one rounding of Qwen2RMSNorm's; 896 and 100: rows past a power of two, a partial program.
for shape in [(2, 5, 896), (3, 100)]:
    norm = RMSNorm(shape[-1], 1e-6).half()
    with torch.no_grad():
        norm.weight.normal_()
        x, delta = torch.randn(shape).half(), torch.randn(shape).half()
        y = rms_norm(x, norm.weight, norm.eps)
        total, y2 = rms_norm(x, norm.weight, norm.eps, residual=delta)
        assert torch.equal(total, x + delta)
        for got, want in ((y, norm(x)), (y2, norm(x + delta))):
            err = float((got.float() - want.float()).abs().max())
            assert torch.allclose(got.float(), want.float(), rtol=2e-3, atol=2e-3), err
# The Qwen2 stage (fp32) with its kernels (every add-and-norm, RoPE, SiLU * up), against torch's ops.
args = EncoderV2Args.tiny()
encoder = Qwen2Encoder(args)
with torch.no_grad():
    for p in encoder.parameters():
        p.normal_(0, 0.2)
    features = torch.randn(2, args.qwen2_width, 12, 12)
    reference = encoder(features)
    model._takes = lambda x, flag: flag  # the GPU's kernels, here in Triton's interpreter on CPU
    fused = encoder(features)
err = float(((fused - reference).norm() / reference.norm()))
assert err < 1e-5, err
print("qwen2 kernels ok", err)
"""


def test_qwen2_kernels_equal_the_reference_in_triton_interpreter():
    """The Qwen2 stage's Triton kernels against torch's ops, run by Triton's CPU interpreter:
    RoPE bit for bit `apply_rope`; SiLU(gate) * up; encoder/triton_norm.py's RMSNorm (the
    residual add in its pass) against Qwen2RMSNorm; and the whole stage with all of them."""
    pytest.importorskip("triton")
    assert "qwen2 kernels ok" in run_in_triton_interpreter(QWEN2_KERNELS_IN_INTERPRETER)


@pytest.mark.gpu
def test_qwen2_kernels_equal_torch_on_gpu():
    """bf16 at the real dims: RoPE and SiLU(gate) * up bit for bit torch's ops; the residual sum
    bit for bit the separate add's, the norm within one rounding of Qwen2RMSNorm's."""
    import torch.nn.functional as F

    from encoder.qwen2_model import RMSNorm, apply_rope, rope_tables
    from encoder.triton_activation import silu_mul
    from encoder.triton_norm import rms_norm
    from encoder.triton_rope import rope
    torch.manual_seed(0)
    cos, sin = rope_tables(512, 64, 1e6, torch.device("cuda"), torch.bfloat16)
    for heads in (14, 2):
        x = torch.randn(8, 512, heads * 64, device="cuda", dtype=torch.bfloat16)
        want = apply_rope(x.view(8, 512, heads, 64).transpose(1, 2), cos, sin)
        assert torch.equal(rope(x, cos, sin, 64).view(8, 512, heads, 64).transpose(1, 2), want)
    gate, up = (torch.randn(2048, 4864, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    assert torch.equal(silu_mul(gate, up), F.silu(gate) * up)
    norm = RMSNorm(896, 1e-6).cuda()
    with torch.no_grad():
        norm.weight.normal_()
        norm.to(torch.bfloat16)
        x, delta = (torch.randn(8, 512, 896, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        total, y = rms_norm(x, norm.weight, norm.eps, residual=delta)
        assert torch.equal(total, x + delta)
        torch.testing.assert_close(y, norm(x + delta), rtol=0.016, atol=0.016)
        torch.testing.assert_close(rms_norm(x, norm.weight, norm.eps), norm(x), rtol=0.016, atol=0.016)

"""The two batched paths, the per-image assembly (token layout of DeepSeek-OCR §2) and the
in-process engine's token counts."""
import pytest
import torch
from PIL import Image

from encoder import DualPathEncoder, assemble, preprocess


def pixels(n, size, seed=0):
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def test_global_path_shape_and_newline_column(tiny_encoder):
    with torch.inference_mode():
        out = tiny_encoder.forward_global(pixels(2, 1024))
        views = tiny_encoder.forward_views(pixels(2, 1024))
    d = tiny_encoder.args.n_embed
    assert out.shape == (2, 272, d)
    grid = out.reshape(2, 16, 17, d)
    assert torch.equal(grid[:, :, 16], tiny_encoder.image_newline.expand(2, 16, d))
    assert torch.equal(grid[:, :, :16].reshape(2, 256, d), views)


def test_local_path_shape(tiny_encoder):
    with torch.inference_mode():
        assert tiny_encoder.forward_local(pixels(3, 640)).shape == (3, 100, tiny_encoder.args.n_embed)


def test_batch_rows_are_independent(tiny_encoder):
    # Padding a graph batch with dummy rows relies on this: no cross-image attention.
    x = pixels(3, 640, seed=1)
    with torch.inference_mode():
        batched = tiny_encoder.forward_local(x)
        single = tiny_encoder.forward_local(x[1:2])
    torch.testing.assert_close(batched[1:2], single, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grid", [(2, 3), (3, 2), (1, 6), (2, 1)])
def test_assemble_layout(tiny_encoder, grid):
    w_t, h_t = grid
    d = 4
    newline, separator = torch.full((d,), -1.0), torch.full((d,), -2.0)  # markers
    # crop k, cell (r, c) of its 10x10 grid carries the marker (k, r, c).
    crops = torch.zeros(w_t * h_t, 100, d)
    for k in range(w_t * h_t):
        for r in range(10):
            for c in range(10):
                crops[k, r * 10 + c] = torch.tensor([k, r, c, 7.0])
    glob = torch.full((272, d), 5.0)
    seq = assemble(glob, crops, grid, newline, separator)
    assert seq.shape[0] == (10 * h_t) * (10 * w_t + 1) + 273
    # Row-major stitching: global row R, column C come from crop (R//10)*w_t + C//10.
    rows = seq[: (10 * h_t) * (10 * w_t + 1)].reshape(10 * h_t, 10 * w_t + 1, d)
    for big_r in range(10 * h_t):
        assert torch.equal(rows[big_r, -1], newline)
        for big_c in range(10 * w_t):
            k = (big_r // 10) * w_t + big_c // 10
            assert rows[big_r, big_c].tolist() == [k, big_r % 10, big_c % 10, 7.0]
    assert torch.equal(seq[-273:-1], glob) and torch.equal(seq[-1], separator)


def test_assemble_untiled_ignores_crops(tiny_encoder):
    glob = torch.randn(272, tiny_encoder.args.n_embed)
    seq = assemble(glob, None, (1, 1), tiny_encoder.image_newline, tiny_encoder.view_seperator)
    assert seq.shape[0] == 273 and torch.equal(seq[:272], glob)


@pytest.mark.parametrize("mode, size, tokens", [
    ("gundam", (300, 200), 273), ("gundam", (1191, 1684), 903), ("gundam", (1920, 1080), 483),
    ("tiny", (900, 700), 73), ("small", (900, 700), 111), ("base", (900, 700), 273),
    ("large", (900, 700), 421),
])
def test_encode_images_token_counts(tiny_encoder, mode, size, tokens):
    image = Image.new("RGB", size, (200, 30, 90))
    (seq,) = DualPathEncoder(tiny_encoder).encode_images([image], mode=mode)
    assert seq.shape == (tokens, tiny_encoder.args.n_embed)
    assert preprocess(image, mode=mode).num_tokens == tokens


def test_encode_images_batch_equals_one_by_one(tiny_encoder):
    images = [Image.new("RGB", s, c) for s, c in [((1191, 1684), (10, 20, 30)),
                                                  ((400, 300), (90, 90, 9)),
                                                  ((640, 3840), (250, 1, 1))]]
    engine = DualPathEncoder(tiny_encoder)
    together = engine.encode_images(images)
    alone = [engine.encode_images(im)[0] for im in images]
    assert [t.shape[0] for t in together] == [903, 273, 933]
    for a, b in zip(together, alone):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bf16_runs_on_cpu(tiny_checkpoint):
    from encoder import load_encoder
    encoder = load_encoder(tiny_checkpoint, dtype=torch.bfloat16)
    (seq,) = DualPathEncoder(encoder).encode_images([Image.new("RGB", (1400, 700), (1, 2, 3))])
    assert seq.dtype == torch.bfloat16 and seq.shape[0] == 483 and torch.isfinite(seq).all()


@pytest.mark.gpu
def test_real_dims_bf16_cuda_matches_fp32_and_dense():
    from encoder import EncoderArgs
    from encoder.checkpoint import random_encoder
    args = EncoderArgs()
    fp32 = random_encoder(args, device="cuda", dtype=torch.float32)
    bf16 = random_encoder(args, device="cuda", dtype=torch.bfloat16)
    views, crops = pixels(2, 1024).cuda(), pixels(3, 640, seed=2).cuda()

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    with torch.inference_mode():
        exact = [fp32.forward_global(views), fp32.forward_local(crops)]
        fused = [bf16.forward_global(views), bf16.forward_local(crops)]
        dense = [bf16.set_attention("dense").forward_global(views), bf16.forward_local(crops)]
    for f, d, e in zip(fused, dense, exact):
        assert f.dtype == torch.bfloat16 and torch.isfinite(f).all()
        print(f"bf16 fused vs fp32 {rel(f, e):.2e}, bf16 dense vs fp32 {rel(d, e):.2e}")
        assert rel(f, e) <= 2e-2 and rel(d, e) <= 2e-2
        assert rel(f, d) <= 2e-2


def test_linear_gelu_epilogue_branch_keeps_shapes_and_values(monkeypatch):
    """The GELU-epilogue branch (a GPU's, here forced on CPU, where torch's _addmm_activation
    applies GELU after the matmul) gives linear + GELU for [B, T, C] inputs; off, the two ops."""
    import torch.nn.functional as F
    from encoder import model
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(16, 48), torch.randn(2, 5, 16)
    with torch.no_grad():
        assert torch.equal(model.linear_gelu(lin, x), F.gelu(lin(x)))  # CPU: the two ops
        monkeypatch.setattr(model, "_epilogue_takes", lambda linear, x: True)
        forced = model.linear_gelu(lin, x)
    assert forced.shape == (2, 5, 48)
    torch.testing.assert_close(forced, F.gelu(lin(x), approximate="tanh"), rtol=0, atol=1e-3)


def _position_weights(encoder):
    """The weights the derived tables come from: SAM's position grid, CLIP's position table and
    the relative-position tables of SAM's first global-attention block."""
    attn = encoder.sam_model.blocks[encoder.args.sam_global_blocks[0]].attn
    return [encoder.sam_model.pos_embed, encoder.vision_model.embeddings.position_embedding.weight,
            attn.rel_pos_h, attn.rel_pos_w]


def test_derived_tables_are_made_once_and_equal_to_making_them_each_forward(tiny_checkpoint, monkeypatch):
    from encoder import derived, load_encoder
    encoder = load_encoder(tiny_checkpoint)  # its own: the tables are kept on its weights
    views, crops = pixels(1, 1024), pixels(2, 640, seed=1)

    def both_paths():
        with torch.inference_mode():
            return encoder.forward_global(views), encoder.forward_local(crops)
    monkeypatch.setattr(derived, "ENABLED", False)
    reference = both_paths()
    assert all("_derived_tables" not in w.__dict__ for w in _position_weights(encoder))
    monkeypatch.setattr(derived, "ENABLED", True)
    first, second = both_paths(), both_paths()
    pos_tables = _position_weights(encoder)[0].__dict__["_derived_tables"]
    assert set(pos_tables) == {(40,)}  # a crop's grid; a global view's is the weight itself
    kept = {key: table for key, (_, table) in pos_tables.items()}
    both_paths()
    assert all(pos_tables[key][1] is table for key, table in kept.items())  # not made again
    for made_each_time, once, again in zip(reference, first, second):
        assert torch.equal(made_each_time, once) and torch.equal(made_each_time, again)

    # An in-place update of a weight (its version bumps) remakes its tables.
    with torch.no_grad():
        for weight in _position_weights(encoder):
            weight.add_(0.25)
    updated = both_paths()
    monkeypatch.setattr(derived, "ENABLED", False)
    expected = both_paths()
    for new, old, want in zip(updated, first, expected):
        assert torch.equal(new, want) and not torch.equal(new, old)


def test_derived_tables_are_not_kept_where_autograd_records(tiny_checkpoint):
    from encoder import load_encoder
    encoder = load_encoder(tiny_checkpoint).requires_grad_(True)
    with torch.no_grad():
        encoder.forward_local(pixels(1, 640))  # keeps the tables, made outside autograd
    encoder.forward_local(pixels(1, 640)).float().square().sum().backward()
    for weight in _position_weights(encoder):
        assert weight.grad is not None and weight.grad.abs().sum() > 0


def test_derived_tables_do_not_keep_their_encoder_alive(tiny_checkpoint):
    """Tables are kept on their weights; one that is a view of its weight (a size the weight
    was stored for) is not, or the weight would reference itself and never be freed."""
    import gc
    import weakref

    from encoder import load_encoder
    encoder = load_encoder(tiny_checkpoint)
    with torch.inference_mode():
        encoder.forward_global(pixels(1, 1024))
        encoder.forward_local(pixels(1, 640))
    weights = [weakref.ref(w) for w in encoder.parameters()]
    del encoder
    gc.collect()
    assert all(w() is None for w in weights)

"""The dual-path engine: eager on CPU (== encode_images), graphs on CUDA (marked gpu)."""
import pytest
import torch
from PIL import Image

from encoder import EncoderArgs, preprocess
from encoder.checkpoint import random_encoder
from encoder.graphs import DualPathEncoder, PathGraphs
from scheduler import PathBudgets


def image(w, h, seed):
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (h // 16 + 1, w // 16 + 1, 3), dtype=torch.uint8, generator=gen)
    return Image.fromarray(noise.numpy()).resize((w, h), Image.BILINEAR)


# untiled photo, A4 page (2x3), 1x6 strip, 2x2 square, 2x1 landscape, small image
MIXED = [(448, 448), (1191, 1684), (640, 3840), (1024, 1024), (1400, 700), (300, 200)]


def small_budgets():
    return (PathBudgets.geometric("global", 272, 3), PathBudgets.geometric("local", 100, 8))


def test_eager_engine_equals_encode_images_cpu(tiny_encoder):
    images = [image(w, h, i) for i, (w, h) in enumerate(MIXED)]
    engine = DualPathEncoder(tiny_encoder, small_budgets(), max_items=3)
    assert not engine.global_path.graphs and not engine.local_path.graphs  # CPU: eager
    got = engine.encode_images(images)
    expected = tiny_encoder.encode_images(images)
    assert [g.shape[0] for g in got] == [273, 903, 933, 693, 483, 273]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    stats = engine.stats()  # eager on CPU: every non-empty batch is a miss
    assert stats["global"]["graph_hits"] == stats["local"]["graph_hits"] == 0
    assert stats["global"]["real_tokens"] == 272 * len(images)
    assert stats["local"]["real_tokens"] == 100 * (6 + 6 + 4 + 2)


def test_mixed_modes_are_planned_per_view_size(tiny_encoder):
    items = [preprocess(image(900, 700, 1), mode="tiny"), preprocess(image(1191, 1684, 2)),
             preprocess(image(900, 700, 3), mode="large")]
    engine = DualPathEncoder(tiny_encoder, small_budgets(), max_items=3)
    got = engine.encode(items)
    assert [g.shape[0] for g in got] == [73, 903, 421]
    for g, e in zip(got, eager_reference(tiny_encoder, items)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_empty_batch_is_an_error(tiny_encoder):
    path = PathGraphs("local", tiny_encoder.forward_local, small_budgets()[1], (3, 640, 640), "cpu")
    with pytest.raises(ValueError, match="empty batch"):
        path.run(torch.zeros(0, 3, 640, 640, dtype=torch.uint8))
    with pytest.raises(ValueError, match="need a CUDA device"):
        PathGraphs("local", tiny_encoder.forward_local, small_budgets()[1], (3, 640, 640), "cpu",
                   use_graphs=True)


def eager_reference(enc, items):
    """Each image alone through the two forwards, no engine."""
    with torch.inference_mode():
        return [enc.assemble(enc.forward_global(it.global_view[None].to(enc.device))[0],
                             enc.forward_local(it.crops.to(enc.device)) if it.tiled else None,
                             it.grid)
                for it in items]


# --- GPU ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cuda_engine():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    encoder = random_encoder(EncoderArgs(), device="cuda", dtype=torch.bfloat16)
    budgets = (PathBudgets.geometric("global", 272, 4), PathBudgets.geometric("local", 100, 6))
    engine = DualPathEncoder(encoder, budgets, max_items=4)
    report = engine.stats()["capture"]
    print(f"\ngraph memory: {engine.graph_memory_bytes / 2**30:.2f} GB "
          f"(global {report['global']}, local {report['local']})")
    return engine




@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [
    [(448, 448), (300, 200), (500, 640)],                 # all untiled: local path skipped
    [(1191, 1684), (1024, 1024)],                         # all tiled
    [(448, 448), (1191, 1684), (1400, 700), (300, 200)],  # mixed
], ids=["untiled", "tiled", "mixed"])
def test_graph_equals_eager(cuda_engine, sizes):
    items = [preprocess(image(w, h, i)) for i, (w, h) in enumerate(sizes)]
    before = cuda_engine.stats()
    got = cuda_engine.encode(items)
    after = cuda_engine.stats()
    assert after["global"]["graph_hits"] > before["global"]["graph_hits"]
    for g, e in zip(got, eager_reference(cuda_engine.encoder, items)):
        torch.testing.assert_close(g, e, rtol=0.016, atol=0.016)


@pytest.mark.gpu
def test_oversized_local_batch_falls_back_while_global_replays(cuda_engine):
    # A 3x3-tiled image has 9 crops, over the local path's largest budget (6): its batch runs the
    # local path eagerly while the global path still replays its graph.
    items = [preprocess(image(2000, 2000, 5), max_crops=9), preprocess(image(448, 448, 6))]
    assert items[0].grid == (3, 3)
    before = cuda_engine.stats()
    got = cuda_engine.encode(items)
    after = cuda_engine.stats()
    assert after["local"]["graph_misses"] == before["local"]["graph_misses"] + 1
    assert after["global"]["graph_hits"] >= before["global"]["graph_hits"] + 1
    assert after["global"]["graph_misses"] == before["global"]["graph_misses"]
    for g, e in zip(got, eager_reference(cuda_engine.encoder, items)):
        torch.testing.assert_close(g, e, rtol=0.016, atol=0.016)


@pytest.mark.gpu
def test_results_survive_later_replays(cuda_engine):
    first_items = [preprocess(image(1191, 1684, 11)), preprocess(image(448, 448, 12))]
    first = cuda_engine.encode(first_items)
    kept = [t.clone() for t in first]
    for seed in range(3):  # replay the same graphs with other data
        cuda_engine.encode([preprocess(image(1191, 1684, 20 + seed)), preprocess(image(448, 448, 30 + seed))])
    for a, b in zip(first, kept):
        assert torch.equal(a, b)

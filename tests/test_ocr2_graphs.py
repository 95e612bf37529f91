"""DeepSeek-OCR-2 through the one encode engine (`DualPathEncoder`): its paths planned at its own
token budgets (256 per global view, 144 per 768² crop), eager on CPU equal to each image alone,
and on a GPU (marked gpu) its graphs equal to eager, per path."""
import pytest
import torch

from encoder import DEEPSEEK_OCR_2, DualPathEncoder, EncoderV2Args, preprocess, random_encoder
from scheduler import PathBudgets
from tests.test_graphs import image

# Untiled, a page (2x3 with 768 tiles), a strip (1x6), a square (2x2), a landscape (2x1), small.
SIZES = [(700, 500), (1191, 1684), (640, 3840), (1600, 1600), (1400, 700), (300, 200)]


def eager_reference(encoder, items):
    """Each image alone through the two forwards, laid out by the encoder's own `sequence`."""
    with torch.inference_mode():
        return [encoder.sequence(encoder.forward_global(it.global_view[None].to(encoder.device))[0],
                                 encoder.forward_local(it.crops.to(encoder.device)) if it.tiled else None,
                                 it.grid)
                for it in items]


def test_engine_plans_ocr2_views_at_its_own_budgets_and_equals_each_image_alone_cpu():
    encoder = random_encoder(EncoderV2Args.tiny(), seed=1)
    engine = DualPathEncoder(encoder, max_images=3)
    assert engine.global_path.budgets.unit == 256 and engine.local_path.budgets.unit == 144
    assert engine.local_path.view_shape == (3, 768, 768)
    images = [image(w, h, i) for i, (w, h) in enumerate(SIZES)]
    got = engine.encode_images(images)
    items = [preprocess(im, tiling=DEEPSEEK_OCR_2) for im in images]
    assert [it.grid for it in items] == [(1, 1), (2, 3), (1, 6), (2, 2), (2, 1), (1, 1)]
    assert [g.shape[0] for g in got] == [257, 257 + 6 * 144, 257 + 6 * 144, 257 + 4 * 144,
                                         257 + 2 * 144, 257]
    for g, e in zip(got, eager_reference(encoder, items)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    stats = engine.stats()
    assert stats["global"]["real_tokens"] == 256 * len(images)
    assert stats["local"]["real_tokens"] == 144 * (6 + 6 + 4 + 2)


@pytest.fixture(scope="module")
def cuda_ocr2_engine():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    encoder = random_encoder(EncoderV2Args(), device="cuda", dtype=torch.bfloat16)
    budgets = (PathBudgets.geometric("global", 256, 4), PathBudgets.geometric("local", 144, 6))
    engine = DualPathEncoder(encoder, budgets, max_images=4)
    report = engine.stats()
    print(f"\nOCR-2 graph memory: {engine.graph_memory_bytes / 2**30:.2f} GB "
          f"(global {report['global']['capture']}, local {report['local']['capture']})")
    return engine


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [
    [(700, 500), (300, 200)],                            # all untiled: local path skipped
    [(1191, 1684), (1600, 1600)],                        # all tiled
    [(700, 500), (1191, 1684), (1400, 700), (300, 200)],  # mixed
], ids=["untiled", "tiled", "mixed"])
def test_ocr2_graphs_equal_eager(cuda_ocr2_engine, sizes):
    items = [preprocess(image(w, h, i), tiling=DEEPSEEK_OCR_2) for i, (w, h) in enumerate(sizes)]
    before = cuda_ocr2_engine.stats()
    got = cuda_ocr2_engine.encode(items)
    after = cuda_ocr2_engine.stats()
    assert after["global"]["graph_hits"] > before["global"]["graph_hits"]
    if any(it.tiled for it in items):
        assert after["local"]["graph_hits"] > before["local"]["graph_hits"]
    for g, e in zip(got, eager_reference(cuda_ocr2_engine.encoder, items)):
        torch.testing.assert_close(g, e, rtol=0.016, atol=0.016)


@pytest.mark.gpu
def test_ocr2_graphs_switch_off_runs_eagerly_with_the_same_results(cuda_ocr2_engine):
    items = [preprocess(image(1191, 1684, 3), tiling=DEEPSEEK_OCR_2)]
    eager = DualPathEncoder(cuda_ocr2_engine.encoder, max_images=4, use_graphs=False)
    assert not eager.global_path.graphs and not eager.local_path.graphs
    torch.testing.assert_close(eager.encode(items)[0], cuda_ocr2_engine.encode(items)[0],
                               rtol=0.016, atol=0.016)

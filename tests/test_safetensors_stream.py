"""common/safetensors_stream.py: checkpoints read by large sequential reads equal, bit for bit,
what safetensors' own reader (the reference twin, DEEPSEEK_OCR_STREAM_WEIGHTS=0) gives."""
import os

import pytest
import torch
from safetensors import safe_open

from common.checkpoint import CheckpointError, read_tensors, save_checkpoint
from common.safetensors_stream import stream_tensors


def mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.big": torch.randn(64, 300, generator=g).bfloat16(),  # 38,400 bytes: pieces at small chunks
        "a.half": torch.randn(7, 5, generator=g).half(),
        "a.float": torch.randn(3, 4, 5, generator=g),
        "b.long": torch.randint(-10**12, 10**12, (9,), generator=g),
        "b.flag": torch.rand(11, generator=g) > 0.5,
        "b.byte": torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
        "b.fp8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        "b.u32": torch.arange(2**32 - 5, 2**32, dtype=torch.int64).to(torch.uint32),
        "c.scalar": torch.tensor(2.5, dtype=torch.bfloat16),
        "c.empty": torch.zeros(0, 4),
        "skip.me": torch.randn(50, 50, generator=g),  # not kept: a gap between kept tensors
    }


def keep(key: str) -> bool:
    return not key.startswith("skip.")


def read_both(path, monkeypatch, dtype=None):
    timings = {}, {}
    monkeypatch.setenv("DEEPSEEK_OCR_STREAM_WEIGHTS", "0")
    mapped = read_tensors(path, keep, dtype=dtype, timings=timings[0])
    monkeypatch.setenv("DEEPSEEK_OCR_STREAM_WEIGHTS", "1")
    streamed = read_tensors(path, keep, dtype=dtype, timings=timings[1])
    return mapped, streamed, timings


def assert_identical(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
        assert torch.equal(got[key].view(-1).view(torch.uint8), want[key].view(-1).view(torch.uint8)), key


@pytest.mark.parametrize("shards", [None, 3])
@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_streamed_checkpoint_equals_safetensors_reader(tmp_path, monkeypatch, shards, dtype):
    save_checkpoint(tmp_path, {}, mixed_tensors(), num_shards=shards)
    mapped, streamed, timings = read_both(tmp_path, monkeypatch, dtype)
    assert_identical(streamed, mapped)
    assert "skip.me" not in streamed and streamed["b.long"].dtype == torch.int64
    assert streamed["a.big"].dtype == (dtype or torch.bfloat16)
    assert timings[0].keys() == timings[1].keys() and timings[0]["gb"] == timings[1]["gb"]


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("chunk_bytes", [64, 1000, 4096, 1 << 20])
def test_pieces_and_shared_reads_land_where_they_belong(tmp_path, chunk_bytes, threads):
    """Chunks smaller than one tensor (it arrives in pieces), than a few (neighbours share a
    read), and larger than the file (one read); one reader or several at once."""
    tensors = mixed_tensors()
    save_checkpoint(tmp_path, {}, tensors)
    file = os.path.join(tmp_path, "model.safetensors")
    keys = [k for k in tensors if keep(k)]
    timings = {}
    got = stream_tensors(file, keys, "cpu", chunk_bytes=chunk_bytes, threads=threads, timings=timings)
    with safe_open(file, "pt") as f:
        assert_identical(got, {k: f.get_tensor(k) for k in keys})
    assert timings["bytes"] == sum(t.numel() * t.element_size() for k, t in tensors.items() if keep(k))


def test_truncated_and_corrupt_files_are_one_clear_error(tmp_path):
    save_checkpoint(tmp_path, {}, mixed_tensors())
    file = os.path.join(tmp_path, "model.safetensors")
    data = open(file, "rb").read()
    with open(file, "wb") as f:
        f.write(data[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        read_tensors(tmp_path, keep)
    with open(file, "wb") as f:
        f.write(data[:8] + b"{not json" + data[17:])
    with pytest.raises(CheckpointError, match="unreadable safetensors header"):
        read_tensors(tmp_path, keep)
    with open(file, "wb") as f:
        f.write(b"\x01")
    with pytest.raises(CheckpointError, match="too short"):
        read_tensors(tmp_path, keep)


def test_keys_the_file_lacks_are_listed(tmp_path):
    save_checkpoint(tmp_path, {}, mixed_tensors())
    with pytest.raises(KeyError):
        stream_tensors(os.path.join(tmp_path, "model.safetensors"), ["a.big", "nope"], "cpu")


@pytest.mark.gpu
def test_streamed_to_the_gpu_equals_the_reference(tmp_path, monkeypatch):
    """Pinned buffers used in turn (small chunks: many refills) and casts on the device."""
    save_checkpoint(tmp_path, {}, mixed_tensors(), num_shards=2)
    monkeypatch.setattr("common.safetensors_stream.CHUNK_BYTES", 1000)
    for dtype in (None, torch.bfloat16):
        mapped, streamed, _ = read_both(tmp_path, monkeypatch, dtype)
        assert all(t.is_cuda is False for t in mapped.values())
        monkeypatch.setenv("DEEPSEEK_OCR_STREAM_WEIGHTS", "1")
        on_gpu = read_tensors(tmp_path, keep, device="cuda", dtype=dtype)
        assert all(t.is_cuda for t in on_gpu.values())
        assert_identical({k: t.cpu() for k, t in on_gpu.items()}, mapped)

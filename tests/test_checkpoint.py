"""Checkpoint loading in the released layout: round trip, shards, and every error case."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from encoder import CheckpointError, EncoderArgs, load_encoder, write_random_checkpoint
from common.checkpoint import INDEX_FILE, SINGLE_FILE

PIXELS = torch.randint(0, 256, (1, 3, 640, 640), dtype=torch.uint8,
                       generator=torch.Generator().manual_seed(0))


def features(encoder):
    with torch.inference_mode():
        return encoder.forward_local(PIXELS)


def test_released_key_names(tiny_checkpoint):
    keys = set(load_file(os.path.join(tiny_checkpoint, SINGLE_FILE)))
    for key in ["model.sam_model.blocks.1.attn.rel_pos_h", "model.sam_model.neck.3.bias",
                "model.sam_model.net_3.weight", "model.sam_model.patch_embed.proj.weight",
                "model.vision_model.embeddings.patch_embedding.weight",
                "model.vision_model.pre_layrnorm.weight",
                "model.vision_model.transformer.layers.1.self_attn.qkv_proj.weight",
                "model.projector.layers.weight", "model.image_newline", "model.view_seperator"]:
        assert key in keys
    config = json.load(open(os.path.join(tiny_checkpoint, "config.json")))
    assert config["model_type"] == "deepseek_vl_v2"
    assert EncoderArgs.from_config(config) == EncoderArgs.tiny()


def test_real_config_layout_reads_real_dims():
    config = EncoderArgs().to_config()
    assert "window_size" not in config["vision_config"]["width"]["sam_vit_b"]  # released fields only
    assert EncoderArgs.from_config(config) == EncoderArgs()
    assert config["projector_config"]["input_dim"] == 2048


def test_round_trip_same_outputs(tmp_path, tiny_args):
    a = load_encoder(write_random_checkpoint(tmp_path / "a", tiny_args, seed=3, dtype=torch.float32))
    b = load_encoder(write_random_checkpoint(tmp_path / "b", tiny_args, seed=3, dtype=torch.float32))
    c = load_encoder(write_random_checkpoint(tmp_path / "c", tiny_args, seed=4, dtype=torch.float32))
    assert torch.equal(features(a), features(b))
    assert not torch.allclose(features(a), features(c))
    written = load_file(os.path.join(tmp_path / "a", SINGLE_FILE))
    for name, value in a.state_dict().items():
        assert torch.equal(value, written[f"model.{name}"]), name


def test_bf16_checkpoint_loads_into_fp32(tmp_path, tiny_args):
    path = write_random_checkpoint(tmp_path, tiny_args)  # bf16 like the release
    encoder = load_encoder(path, dtype=torch.float32)
    assert encoder.dtype == torch.float32
    assert load_file(os.path.join(path, SINGLE_FILE))["model.image_newline"].dtype == torch.bfloat16


def test_sharded_index(tmp_path, tiny_args, tiny_checkpoint):
    path = write_random_checkpoint(tmp_path, tiny_args, seed=0, dtype=torch.float32, num_shards=3)
    assert not os.path.exists(os.path.join(path, SINGLE_FILE))
    weight_map = json.load(open(os.path.join(path, INDEX_FILE)))["weight_map"]
    assert len(set(weight_map.values())) == 3
    assert torch.equal(features(load_encoder(path)), features(load_encoder(tiny_checkpoint)))


def test_language_keys_are_ignored(tmp_path, tiny_args):
    extra = {"model.embed_tokens.weight": torch.zeros(10, 64), "lm_head.weight": torch.zeros(10, 64)}
    path = write_random_checkpoint(tmp_path, tiny_args, extra_tensors=extra,
                                   extra_config={"vocab_size": 10})
    load_encoder(path)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_transformers_resaved_checkpoint_with_position_ids_loads(tmp_path, tiny_args, tiny_checkpoint, dtype):
    """What every fine-tune saves: CLIP's position-ids buffer [1, 257], any float dtype."""
    path = write_random_checkpoint(tmp_path, tiny_args, dtype=dtype, extra_tensors={
        "model.vision_model.embeddings.position_ids": torch.arange(257)[None]})
    encoder = load_encoder(path)
    assert encoder.dtype == torch.float32
    if dtype == torch.float32:
        assert torch.equal(features(encoder), features(load_encoder(tiny_checkpoint)))


def test_position_ids_that_are_not_positions_are_refused(tmp_path, tiny_args):
    path = write_random_checkpoint(tmp_path, tiny_args, extra_tensors={
        "model.vision_model.embeddings.position_ids": torch.arange(257).flip(0)[None]})
    with pytest.raises(CheckpointError, match="position_ids is not 0..N-1"):
        load_encoder(path)


def _rewrite(path, edit):
    file = os.path.join(path, SINGLE_FILE)
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_missing_unexpected_and_misshaped_keys_in_one_error(tmp_path, tiny_args):
    path = write_random_checkpoint(tmp_path, tiny_args)

    def edit(t):
        del t["model.sam_model.blocks.0.attn.rel_pos_h"]
        del t["model.projector.layers.bias"]
        t["model.sam_model.blocks.99.attn.qkv.weight"] = torch.zeros(2)
        t["model.image_newline"] = torch.zeros(3)

    _rewrite(path, edit)
    with pytest.raises(CheckpointError) as e:
        load_encoder(path)
    msg = str(e.value)
    for text in ["missing keys (2)", "model.sam_model.blocks.0.attn.rel_pos_h",
                 "model.projector.layers.bias", "unexpected keys (1)",
                 "model.sam_model.blocks.99.attn.qkv.weight", "shape mismatches (1)",
                 "model.image_newline: checkpoint (3,), model (64,)"]:
        assert text in msg


def test_config_dims_disagree_with_weights(tmp_path, tiny_args):
    path = write_random_checkpoint(tmp_path, tiny_args)
    config = json.load(open(os.path.join(path, "config.json")))
    config["vision_config"]["width"]["sam_vit_b"]["layers"] = 5
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="missing keys \\(14\\)"):
        load_encoder(path)


def test_missing_files(tmp_path, tiny_args):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_encoder(tmp_path)
    path = write_random_checkpoint(tmp_path / "ck", tiny_args)
    os.remove(os.path.join(path, SINGLE_FILE))
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load_encoder(path)


def test_missing_shard_and_bad_index(tmp_path, tiny_args):
    path = write_random_checkpoint(tmp_path, tiny_args, num_shards=2)
    index = json.load(open(os.path.join(path, INDEX_FILE)))
    shard = sorted(set(index["weight_map"].values()))[1]
    os.rename(os.path.join(path, shard), os.path.join(path, "elsewhere"))
    with pytest.raises(CheckpointError, match="shards named in .* are missing"):
        load_encoder(path)
    os.rename(os.path.join(path, "elsewhere"), os.path.join(path, shard))
    key = next(k for k, f in index["weight_map"].items() if f == shard)
    index["weight_map"][key] = sorted(set(index["weight_map"].values()))[0]  # points at wrong shard
    json.dump(index, open(os.path.join(path, INDEX_FILE), "w"))
    with pytest.raises(CheckpointError, match="keys listed in the index are not in"):
        load_encoder(path)


def test_bad_config(tmp_path, tiny_args):
    path = write_random_checkpoint(tmp_path, tiny_args)
    open(os.path.join(path, "config.json"), "w").write("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_encoder(path)
    json.dump({"model_type": "deepseek_vl_v2"}, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="lacks vision_config"):
        load_encoder(path)


@pytest.mark.gpu
def test_loads_onto_the_gpu_equal_loads_on_the_cpu(tmp_path):
    """Both halves read straight onto the GPU (the decoder packs its experts there) hold the
    same weights as a CPU load moved over."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from decoder import load_decoder
    from deployments.model_source import write_random_model
    path = write_random_model(tmp_path / "ckpt")
    for load in (load_encoder, load_decoder):
        on_gpu = load(path, device="cuda", dtype=torch.bfloat16).state_dict()
        on_cpu = load(path, device="cpu", dtype=torch.bfloat16).state_dict()
        assert on_gpu.keys() == on_cpu.keys()
        for key, value in on_cpu.items():
            assert on_gpu[key].is_cuda and torch.equal(on_gpu[key].cpu(), value), key


def test_a_replica_that_loses_the_race_to_write_the_tiny_model_keeps_no_copy(tmp_path, monkeypatch):
    """Replicas on one node may each write the tiny random model: the one whose rename finds
    another's copy in place removes its own (66 MB each, left in the temp folder before)."""
    import tempfile

    from deployments import model_source
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    write = model_source.write_random_model

    def write_while_another_replica_wins(staging, *args, **kwargs):
        write(staging, *args, **kwargs)
        write(tmp_path / f"deepseek-ocr-serve-{model_source.TINY_LABEL}-v2", *args, **kwargs)
    monkeypatch.setattr(model_source, "write_random_model", write_while_another_replica_wins)
    directory, _ = model_source.resolve_checkpoint(None)
    assert os.path.isfile(os.path.join(directory, "tokenizer.json"))
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(directory)]


LOAD_WITHOUT_THE_COMPILER = """
import sys
import torch
from deployments.model_source import write_random_model
from decoder.checkpoint import load_decoder
from encoder.checkpoint import load_encoder
path = write_random_model(sys.argv[1])
timings = {}
load_encoder(path, timings=timings), load_decoder(path, timings=timings)
assert timings.keys() == {"open", "read", "to_device", "gb", "build"}, timings
print("torch._dynamo" in sys.modules)
weights = torch.zeros(1000)
torch.nn.init.normal_(weights)  # the initialisers are themselves again
from common.checkpoint import meta_module
inside = []
meta_module(lambda: inside.append(torch.nn.init.normal_(torch.zeros(1000, device="cpu"))))  # real
print(bool(weights.std() > 0.5), bool(inside[0].std() > 0.5))
"""


def test_loading_imports_no_compiler_and_leaves_the_initialisers_working(tmp_path):
    """Modules are built on the meta device with torch.nn.init skipped: there nn.Embedding's
    normal_ imports torch._dynamo (~900 modules, 1-2 s of every replica's start-up). A fresh
    interpreter loads both halves without importing it; the initialisers work after, and on
    real tensors (another thread's) even while a module is built."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_THE_COMPILER, str(tmp_path / "ckpt")],
                         env=dict(os.environ, PYTHONPATH=root), cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["False", "True", "True"], run.stdout

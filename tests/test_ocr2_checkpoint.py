"""DeepSeek-OCR-2 checkpoints in the released layout: config.json read and written, the family
chosen from it, round trips, and one clear error for a missing or mis-shaped key."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.checkpoint import SINGLE_FILE
from encoder import (CheckpointError, DeepEncoder, DeepEncoderV2, EncoderArgs, EncoderV2Args,
                     is_ocr2_config, load_encoder, load_encoder_v2, random_encoder,
                     write_random_checkpoint)

# DeepSeek-OCR-2's released config.json, its vision and projector part (as transcribed by
# OpenVINO GenAI's and mlx-swift's tests of the published file). Its SAM downsample_channels
# still say DeepSeek-OCR's [512, 1024]; the code and the weights have 896 (the Qwen2 width).
RELEASED_CONFIG = {
    "architectures": ["DeepseekOCR2ForCausalLM"],
    "model_type": "deepseek_vl_v2",
    "candidate_resolutions": [[1024, 1024]],
    "tile_tag": "2D",
    "global_view_pos": "head",
    "projector_config": {"input_dim": 896, "model_type": "mlp_projector", "n_embed": 1280,
                         "projector_type": "linear"},
    "vision_config": {
        "image_size": 1024, "mlp_ratio": 3.7362, "model_name": "deepencoderv2", "model_type": "vision",
        "width": {
            "qwen2-0-5b": {"dim": 896},
            "sam_vit_b": {"downsample_channels": [512, 1024], "global_attn_indexes": [2, 5, 8, 11],
                          "heads": 12, "layers": 12, "width": 768},
        },
    },
}
PIXELS = torch.randint(0, 256, (1, 3, 768, 768), dtype=torch.uint8,
                       generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ocr2-tiny"), EncoderV2Args.tiny(),
                                   seed=0, dtype=torch.float32)


def tokens(encoder):
    with torch.inference_mode():
        return encoder.forward_local(PIXELS)


def test_released_config_reads_real_dims():
    assert is_ocr2_config(RELEASED_CONFIG)
    assert EncoderV2Args.from_config(RELEASED_CONFIG) == EncoderV2Args()
    assert EncoderV2Args().downsample_channels == (512, 896)


def test_family_comes_from_the_config():
    assert not is_ocr2_config(EncoderArgs().to_config())
    # Any one OCR-2 marker suffices (re-saved configs keep some of them).
    for marker in ({"architectures": ["DeepseekOCR2ForCausalLM"]},
                   {"vision_config": {"model_name": "deepencoderv2"}},
                   {"vision_config": {"width": {"qwen2-0-5b": {"dim": 896}}}}):
        assert is_ocr2_config(marker)
    assert not is_ocr2_config({"vision_config": None, "architectures": None})


@pytest.mark.parametrize("args", [EncoderV2Args(), EncoderV2Args.tiny()], ids=["real", "tiny"])
def test_config_round_trip(args):
    config = args.to_config()
    assert is_ocr2_config(config) and config["model_type"] == "deepseek_vl_v2"
    assert EncoderV2Args.from_config(json.loads(json.dumps(config))) == args
    extras = {"layers", "heads", "kv_heads", "intermediate_size"}
    assert bool(extras & set(config["vision_config"]["width"]["qwen2-0-5b"])) == (args != EncoderV2Args())


def test_bad_configs_are_named():
    with pytest.raises(ValueError, match="input_dim 1024 != qwen2-0-5b.dim 896"):
        EncoderV2Args.from_config({**RELEASED_CONFIG, "projector_config": {"input_dim": 1024, "n_embed": 1280}})
    with pytest.raises(ValueError, match="qwen2-0-5b"):
        EncoderV2Args.from_config({"vision_config": {"width": {"sam_vit_b": {}}}})
    with pytest.raises(ValueError, match="heads"):
        EncoderV2Args(qwen2_heads=14, qwen2_kv_heads=3)


def test_released_key_names(checkpoint):
    keys = set(load_file(os.path.join(checkpoint, SINGLE_FILE)))
    for key in ["model.sam_model.blocks.1.attn.rel_pos_h", "model.sam_model.net_3.weight",
                "model.qwen2_model.query_768.weight", "model.qwen2_model.query_1024.weight",
                "model.qwen2_model.model.model.layers.1.self_attn.k_proj.bias",
                "model.qwen2_model.model.model.layers.0.mlp.gate_proj.weight",
                "model.qwen2_model.model.model.norm.weight",
                "model.projector.layers.weight", "model.view_seperator"]:
        assert key in keys
    assert not any(k.startswith(("model.vision_model.", "model.image_newline")) for k in keys)
    config = json.load(open(os.path.join(checkpoint, "config.json")))
    assert config["architectures"] == ["DeepseekOCR2ForCausalLM"]
    assert EncoderV2Args.from_config(config) == EncoderV2Args.tiny()


def test_load_encoder_chooses_the_family(checkpoint, tiny_checkpoint):
    assert type(load_encoder(checkpoint)) is DeepEncoderV2
    assert type(load_encoder(tiny_checkpoint)) is DeepEncoder  # DeepSeek-OCR's, as before


def test_round_trip_same_tokens(tmp_path, checkpoint):
    a = load_encoder_v2(checkpoint)
    b = load_encoder_v2(write_random_checkpoint(tmp_path / "b", EncoderV2Args.tiny(), seed=0,
                                                dtype=torch.float32))
    c = load_encoder_v2(write_random_checkpoint(tmp_path / "c", EncoderV2Args.tiny(), seed=1,
                                                dtype=torch.float32))
    assert torch.equal(tokens(a), tokens(b))
    assert not torch.allclose(tokens(a), tokens(c))
    assert torch.equal(tokens(a), tokens(random_encoder(EncoderV2Args.tiny(), seed=0)))
    written = load_file(os.path.join(checkpoint, SINGLE_FILE))
    for name, value in a.state_dict().items():
        assert torch.equal(value, written[f"model.{name}"]), name


def test_bf16_checkpoint_with_language_keys_loads_into_fp32(tmp_path):
    """The release is one bf16 file with the decoder's keys too: those are not the encoder's."""
    language = {"model.embed_tokens.weight": torch.zeros(16, 80), "model.norm.weight": torch.ones(80),
                "model.layers.0.self_attn.q_proj.weight": torch.zeros(80, 80),
                "lm_head.weight": torch.zeros(16, 80)}
    path = write_random_checkpoint(tmp_path, EncoderV2Args.tiny(), extra_tensors=language)
    encoder = load_encoder(path, dtype=torch.float32)
    assert isinstance(encoder, DeepEncoderV2) and encoder.dtype == torch.float32
    assert load_file(os.path.join(path, SINGLE_FILE))["model.view_seperator"].dtype == torch.bfloat16


def rewrite(path, change):
    file = os.path.join(path, SINGLE_FILE)
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_key_is_one_clear_error(tmp_path):
    path = write_random_checkpoint(tmp_path, EncoderV2Args.tiny(), dtype=torch.float32)
    rewrite(path, lambda t: (t.pop("model.qwen2_model.query_768.weight"),
                             t.pop("model.qwen2_model.model.model.layers.1.mlp.up_proj.weight")))
    with pytest.raises(CheckpointError) as error:
        load_encoder(path)
    message = str(error.value)
    assert "missing keys (2)" in message
    assert "model.qwen2_model.query_768.weight" in message
    assert "model.qwen2_model.model.model.layers.1.mlp.up_proj.weight" in message


def test_mis_shaped_key_is_one_clear_error(tmp_path):
    path = write_random_checkpoint(tmp_path, EncoderV2Args.tiny(), dtype=torch.float32)

    def change(t):
        t["model.qwen2_model.query_1024.weight"] = t["model.qwen2_model.query_1024.weight"][:255]
        t["model.qwen2_model.model.model.rotary_emb.inv_freq"] = torch.ones(8)  # a re-save's buffer
    rewrite(path, change)
    with pytest.raises(CheckpointError) as error:
        load_encoder(path)
    message = str(error.value)
    assert "model.qwen2_model.query_1024.weight: checkpoint (255, 64), model (256, 64)" in message
    assert "unexpected keys (1)" in message and "rotary_emb.inv_freq" in message


def test_first_model_weights_under_an_ocr2_config_fail_clearly(tmp_path, tiny_args):
    """DeepSeek-OCR weights with a DeepSeek-OCR-2 config.json: no Qwen2 keys, named."""
    path = write_random_checkpoint(tmp_path, tiny_args, dtype=torch.float32,
                                   extra_config=EncoderV2Args.tiny().to_config())
    with pytest.raises(CheckpointError, match=r"missing keys \(\d+\)[\s\S]*qwen2_model"):
        load_encoder(path)

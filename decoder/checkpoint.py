"""Load the language model from a released-layout checkpoint; write random ones.

The released keys are used unchanged on disk. In memory some weights are packed (see
decoder/model.py): `experts.{e}.gate_proj` and `up_proj` rows become `gate_up_proj[e]`,
`down_proj` becomes `down_proj[e]`; attention's `q_proj`, `k_proj`, `v_proj` rows become
`qkv_proj`, and each MLP's `gate_proj` and `up_proj` rows its `gate_up_proj`. Reading,
validation and writing go through `common.checkpoint` (shared with the encoder), so both halves
of a checkpoint follow the same rules and errors.
"""
from __future__ import annotations

import os
import time

import torch

from common.checkpoint import (build_module, check_state_dict, random_state_dict, read_config,
                               read_tensors, save_checkpoint)

from .config import DecoderArgs
from .model import Decoder

LANGUAGE_PREFIXES = ("model.embed_tokens.", "model.layers.", "model.norm.", "lm_head.")


def released_shapes(args: DecoderArgs) -> dict[str, torch.Size]:
    """Every language tensor of the released layout and its shape."""
    h, i, e, mi = args.hidden, args.intermediate, args.n_experts, args.moe_intermediate
    shapes = {"model.embed_tokens.weight": (args.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (args.vocab_size, h)}
    for layer in range(args.n_layers):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        shapes |= {p + f"self_attn.{n}_proj.weight": (h, h) for n in "qkvo"}
        if args.is_moe(layer):
            shapes[p + "mlp.gate.weight"] = (e, h)
            shared = mi * args.n_shared_experts
            mlps = [(f"mlp.experts.{x}.", mi) for x in range(e)] + [("mlp.shared_experts.", shared)]
        else:
            mlps = [("mlp.", i)]
        for name, width in mlps:
            shapes |= {p + name + "gate_proj.weight": (width, h), p + name + "up_proj.weight": (width, h),
                       p + name + "down_proj.weight": (h, width)}
    return {k: torch.Size(v) for k, v in shapes.items()}


def pack_released(state: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
    """Released keys (model.-prefixed) -> the Decoder module's state dict, in place: each
    released tensor is dropped once packed, so memory never holds the weights twice."""
    def pack(prefix: str, names: tuple[str, ...], packed: str) -> None:
        state[prefix + packed] = torch.cat([state.pop(f"{prefix}{n}.weight") for n in names])

    for layer in range(args.n_layers):
        p = f"model.layers.{layer}."
        pack(p + "self_attn.", ("q_proj", "k_proj", "v_proj"), "qkv_proj.weight")
        pack(p + ("mlp.shared_experts." if args.is_moe(layer) else "mlp."), ("gate_proj", "up_proj"),
             "gate_up_proj.weight")
        if not args.is_moe(layer):
            continue
        p = f"model.layers.{layer}.mlp.experts."
        gate_up, down = [], []
        for x in range(args.n_experts):
            gate_up.append(torch.cat([state.pop(f"{p}{x}.gate_proj.weight"),
                                      state.pop(f"{p}{x}.up_proj.weight")]))
            down.append(state.pop(f"{p}{x}.down_proj.weight"))
        state[p + "gate_up_proj"] = torch.stack(gate_up)
        state[p + "down_proj"] = torch.stack(down)
    return state


def _is_language_key(key: str) -> bool:
    return key.startswith(LANGUAGE_PREFIXES)


def load_decoder(path: str | os.PathLike, device="cpu", dtype=torch.float32,
                 timings: dict | None = None) -> Decoder:
    """The language model of a checkpoint directory, in eval mode (`timings`: see
    common.checkpoint.read_tensors; `build` is the rest: checks, packing, the module)."""
    args = DecoderArgs.from_config(read_config(path))
    # Read straight onto the device: the weights are then packed there (on a GPU, ~6 GB of
    # copies at memory bandwidth instead of a host memcpy that cost seconds of start-up).
    tensors = read_tensors(path, _is_language_key, device, dtype, timings=timings)
    start = time.perf_counter()
    check_state_dict(tensors, released_shapes(args), os.fspath(path))
    decoder = build_decoder(args, tensors, device, dtype)
    if timings is not None:
        if decoder.device.type == "cuda":
            torch.cuda.synchronize()
        timings["build"] = round(time.perf_counter() - start, 2)
    return decoder


def build_decoder(args: DecoderArgs, tensors: dict[str, torch.Tensor], device, dtype) -> Decoder:
    return build_module(lambda: Decoder(args), pack_released(tensors, args), device, dtype)


def random_decoder(args: DecoderArgs, device="cpu", dtype=torch.float32, seed: int = 0) -> Decoder:
    """A random decoder without the disk (benchmarks); weights drawn on `device`."""
    return build_decoder(args, random_state_dict(released_shapes(args), seed, device), device, dtype)


def write_random_checkpoint(path, args: DecoderArgs, seed: int = 0, *, dtype=torch.bfloat16,
                            num_shards: int | None = None, extra_config: dict | None = None,
                            extra_tensors: dict[str, torch.Tensor] | None = None) -> str:
    """Write a randomly initialised language checkpoint in its family's released layout at
    `args`'s dims: `config.json` (DeepSeek-OCR's language fields, or Unlimited-OCR's with its
    architecture and R-SWA window: `DecoderArgs.tiny(sliding_window=8)`) and the language
    tensors, in one `model.safetensors` or `num_shards` shards. bf16 by default, like the
    releases. `extra_config` / `extra_tensors` add other keys (a vision part; the language
    fields and the architecture stay the family's). On CPU it loads as `random_decoder` of the
    same seed. A whole model with tokenizer is `deployments.model_source.write_random_model`.
    Returns the directory."""
    tensors = {k: v.to(dtype) for k, v in random_state_dict(released_shapes(args), seed).items()}
    tensors.update(extra_tensors or {})
    save_checkpoint(path, (extra_config or {}) | args.to_config(), tensors, num_shards)
    return os.fspath(path)


"""The Decoder deployment: the continuous-batching engine behind a Serve handle.

Concurrent calls each submit one request to `AsyncEngine`, whose background thread steps all
running sequences together; `generate` returns the finished text, `generate_stream` yields deltas.
"""
from __future__ import annotations

from collections.abc import AsyncIterator

import ray
from ray import serve

from decoder import (AsyncEngine, GenerationEngine, GenerationRequest, NGramConfig, SamplingParams,
                     load_decoder, load_tokenizer)

from .model_source import cap_gpu_memory, device_and_dtype, resolve_checkpoint
from .wire import Wire, from_wire


def sampling_params(options: dict) -> SamplingParams:
    """Request options (validated upstream) -> SamplingParams."""
    ngram = options.get("ngram") or {}
    ngram_config = (NGramConfig.off() if ngram.get("enabled") is False
                    else NGramConfig(**{k: v for k, v in ngram.items() if k != "enabled"}))
    return SamplingParams(max_tokens=options.get("max_tokens", 8192),
                          stop=tuple(options.get("stop") or ()), ngram=ngram_config)


@serve.deployment(max_ongoing_requests=128, ray_actor_options={"num_cpus": 0.25})
class DecoderServer:
    def __init__(self, checkpoint: str | None = None, max_batch: int = 64, max_len: int | None = None,
                 gpu_memory_fraction: float | None = None, use_graphs: bool | None = None):
        cap_gpu_memory(gpu_memory_fraction)
        device, dtype = device_and_dtype()
        directory, self.model_label = resolve_checkpoint(checkpoint)
        model = load_decoder(directory, device=device, dtype=dtype)
        tokenizer = load_tokenizer(directory if checkpoint else None)
        # use_graphs None: decode-step CUDA graphs on a GPU, eager on CPU.
        self.engine = AsyncEngine(GenerationEngine(model, tokenizer, max_batch, max_len,
                                                   decode_graphs=use_graphs))

    def stats(self) -> dict:
        engine = self.engine.engine
        return {"model": self.model_label, "gpu_ids": ray.get_gpu_ids(),
                "decode_graphs": engine.decode_graphs is not None,
                "running": len(engine.running), "waiting": len(engine.waiting)}

    def check_health(self):
        if not self.engine.alive:
            raise RuntimeError("generation engine thread died")

    def _request(self, prompt_ids: list[int], image_embeds: list[Wire], options: dict):
        return GenerationRequest(prompt_ids, [from_wire(e) for e in image_embeds],
                                 sampling_params(options))

    async def generate(self, prompt_ids: list[int], image_embeds: list[Wire], options: dict) -> dict:
        text, last = [], None
        async for delta in self.engine.generate(self._request(prompt_ids, image_embeds, options)):
            text.append(delta.text)
            last = delta
        return {"text": "".join(text), "finish_reason": last.finish_reason,
                "prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens}

    async def generate_stream(self, prompt_ids: list[int], image_embeds: list[Wire],
                     options: dict) -> AsyncIterator[dict]:
        async for delta in self.engine.generate(self._request(prompt_ids, image_embeds, options)):
            yield {"text": delta.text, "finished": delta.finished, "finish_reason": delta.finish_reason,
                   "prompt_tokens": delta.prompt_tokens, "completion_tokens": delta.completion_tokens}

"""The Decoder deployment: the continuous-batching engine behind a Serve handle.

Concurrent calls each submit one request to `AsyncEngine`, whose background thread steps all
running sequences together (and owns every GPU call, decode-graph capture included), so the
replica's event loop stays free; `generate` returns the finished text, `generate_stream`
yields deltas.
"""
from __future__ import annotations

from collections.abc import AsyncIterator

import ray
from ray import serve

from decoder import (AsyncEngine, GenerationEngine, GenerationRequest, SamplingParams, load_decoder,
                     load_tokenizer)

from .config import AppConfig
from .model_source import cap_gpu_memory, device_and_dtype, resolve_checkpoint
from .protocol import Wire, from_wire


@serve.deployment(max_ongoing_requests=128, ray_actor_options={"num_cpus": 0.25})
class DecoderServer:
    def __init__(self, config: AppConfig):
        cap_gpu_memory(config.gpu_memory_fraction("decoder"))
        device, dtype = device_and_dtype()
        directory, self.model_label = resolve_checkpoint(config.checkpoint)
        model = load_decoder(directory, device=device, dtype=dtype)
        tokenizer = load_tokenizer(directory if config.checkpoint else None)
        # use_graphs None: decode-step CUDA graphs on a GPU, eager on CPU.
        self.engine = AsyncEngine(GenerationEngine(model, tokenizer, config.max_batch, config.max_len,
                                                   decode_graphs=config.use_graphs))

    def stats(self) -> dict:
        engine = self.engine.engine
        return {"model": self.model_label, "gpu_ids": ray.get_gpu_ids(),
                "decode_graphs": engine.decode_graphs is not None,
                "running": len(engine.running), "waiting": len(engine.waiting)}

    def check_health(self):
        if not self.engine.alive:
            raise RuntimeError("generation engine thread died")

    async def generate(self, prompt_ids: list[int], image_embeds: list[Wire],
                       params: SamplingParams) -> dict:
        text, last = [], None
        async for delta in self.generate_stream(prompt_ids, image_embeds, params):
            text.append(delta["text"])
            last = delta
        return {**last, "text": "".join(text)}

    async def generate_stream(self, prompt_ids: list[int], image_embeds: list[Wire],
                              params: SamplingParams) -> AsyncIterator[dict]:
        request = GenerationRequest(prompt_ids, [from_wire(e) for e in image_embeds], params)
        async for delta in self.engine.generate(request):
            yield {"text": delta.text, "finished": delta.finished, "finish_reason": delta.finish_reason,
                   "prompt_tokens": delta.prompt_tokens, "completion_tokens": delta.completion_tokens}

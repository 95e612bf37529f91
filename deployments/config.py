"""The app's arguments: one typed model with every default and limit (README: "App arguments").

`serve run deployments.app:build key=value ...` and a Serve config's `args:` both arrive here
(Ray validates a builder's pydantic argument type); strings from the command line are converted,
unknown keys are refused. Replica counts, GPUs and autoscaling are placement, not arguments:
they live in the Serve config YAMLs.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str | None = Field(
        None, description="checkpoint directory (released layout); none: the tiny random model")
    encode_only: bool = Field(
        False, description="no decoder: only `/v1/encode` and the `encode` handle method")
    use_graphs: bool | None = Field(
        None, description="encoder and decode-step CUDA graphs; none: on when on a GPU")
    max_images: int = Field(
        32, ge=1, le=256, description="images per encoder batch; sets both paths' graph budgets")
    max_graph_memory_gb: float | None = Field(
        None, gt=0, description="cap on each encoder replica's graph memory (largest dropped first)")
    max_batch: int = Field(64, ge=1, le=1024, description="decoder sequences decoded together")
    max_len: int | None = Field(
        None, ge=1024, description="decoder context in tokens; none: the checkpoint's")
    max_images_per_request: int = Field(16, ge=1, le=256, description="images in one request")
    gpu_memory_fraction_global: float | None = Field(
        None, gt=0, le=1, description="GlobalEncoder's cap of its GPU's memory (shared GPUs)")
    gpu_memory_fraction_local: float | None = Field(
        None, gt=0, le=1, description="LocalEncoder's cap of its GPU's memory (shared GPUs)")
    gpu_memory_fraction_decoder: float | None = Field(
        None, gt=0, le=1, description="Decoder's cap of its GPU's memory (shared GPUs)")

    def gpu_memory_fraction(self, deployment: str) -> float | None:
        return getattr(self, f"gpu_memory_fraction_{deployment}")

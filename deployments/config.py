"""The app's arguments: one typed model with every default and limit (README: "App arguments").

`serve run deployments.app:build key=value ...` and a Serve config's `args:` both arrive here
(Ray validates a builder's pydantic argument type); strings from the command line are converted,
unknown keys are refused. Replica counts, GPUs and autoscaling are placement, not arguments:
they live in the Serve config YAMLs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# A replica whose batch or decode step has run this long fails its health check and is replaced:
# a batch of 32 pages takes under a second on a GPU, and a decode step milliseconds.
STUCK_AFTER_S = 300
# Health checks also run the model's real path this often (when the replica is idle): a one-view
# graph replay in an encoder, a one-token forward in the decoder.
PROBE_EVERY_S = 60
# Code defaults of every deployment's shutdown (the YAMLs set their own): a replica going away
# waits this long for its requests in flight, checking every half second. Short, so that Ctrl-C
# on `serve run` ends the app within seconds even while a page is generating (the Router goes
# first, then the tiers it calls); the GPU configs give rolling updates time to finish pages.
SHUTDOWN = {"graceful_shutdown_timeout_s": 2.0, "graceful_shutdown_wait_loop_s": 0.5}
# A served model's name: its id in requests, URLs and deployment names (`Decoder-<name>`).
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str | None = Field(
        None, description="checkpoint directory (released layout), or a tiny random model: "
        "`tiny-random` (DeepSeek-OCR), `tiny-random-ocr2`, `tiny-random-unlimited-ocr`; none: `tiny-random`")
    encode_only: bool = Field(
        False, description="no decoder: only `/v1/encode` and the `encode` handle method")
    use_graphs: bool | None = Field(
        None, description="encoder and decode-step CUDA graphs; none: on when on a GPU")
    max_images: int = Field(
        32, ge=1, le=256, description="images per encoder batch; sets both paths' graph budgets")
    max_graph_memory_gb: float | None = Field(
        None, gt=0, description="cap on each encoder replica's graph memory (largest dropped first)")
    max_batch: int = Field(
        256, ge=1, le=1024, description="decoder sequences decoded together, at most (as many as "
        "the KV cache's pages hold)")
    decoder_queue: int = Field(
        256, ge=0, le=4096, description="requests a Decoder replica holds beside a full batch "
        "(`max_batch`), waiting for a batch slot or KV-cache pages; more are refused at once with "
        "HTTP 503 and Retry-After (waiting ones keep their time limits)")
    kv_cache_gb: float | None = Field(
        None, gt=0, description="decoder KV-cache size in GB (pages shared by all sequences); "
        "none: 70% of what the decoder's GPU memory share leaves after weights, less a 4 GB "
        "working reserve (CPU: up to 256 MB)")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto", description="decoder KV-cache element type: `auto` the model's (bf16 on a GPU); "
        "`fp8` 8-bit floats (e4m3, as vLLM's kv_cache_dtype=fp8): twice the tokens in the same "
        "memory and half the bytes a decode step reads, at fp8's precision (docs/design.md)")
    max_len: int | None = Field(
        None, ge=1024, description="decoder context in tokens; none: the checkpoint's")
    one_encoder: bool = Field(
        False, description="both encoder paths in one deployment, `Encoder`: one process and one "
        "call per image, the paths overlapping on two CUDA streams as in-process (for one "
        "shared GPU; needs views_on_encoder); false: GlobalEncoder and LocalEncoder, each "
        "placed and scaled on its own")
    encoder_in_router: bool = Field(
        False, description="both encoder paths in the Router's own process (its replica takes the "
        "GPU share; for one-GPU nodes): one Serve call per image instead of two, no encoder "
        "deployment; the Router then scales with the GPUs (needs views_on_encoder; "
        "deployments/configs/gpu-shared-encoder-in-router.yaml)")
    views_on_encoder: bool = Field(
        True, description="routers resize nothing (they send the image: decode_on_encoder); the "
        "encoders make the views on their "
        "device (GPU: PIL's exact bicubic arithmetic as tensor math; CPU: PIL); false: routers "
        "make them with PIL")
    decode_on_encoder: bool = Field(
        True, description="with views_on_encoder, routers read only a PNG's or JPEG's header "
        "(its size, orientation and grid) and send its bytes; the encoders decode it (a page's "
        "bytes are ~30x smaller than its pixels); false, and for other formats: routers decode")
    views_on_arrival: bool = Field(
        True, description="with views_on_encoder, a GPU encoder makes each request's views as "
        "it arrives (a thread and CUDA stream of their own, while the batch before runs); "
        "false (and on CPUs): in its batch, before the batch runs")
    encoder_decode_threads: int = Field(
        4, ge=1, le=64, description="threads an encoder replica decodes the image bytes it is sent "
        "on (decode_on_encoder; PIL releases the GIL while it inflates); 12 were no faster than 4 "
        "on an H200 at 64 pages in flight")
    max_images_per_request: int = Field(16, ge=1, le=256, description="images in one request")
    max_request_mb: int = Field(64, ge=1, le=2048, description="largest request body (HTTP 413 above)")
    max_pages: int = Field(5000, ge=1, le=100_000, description="pages of one PDF (HTTP 413 above)")
    pages_in_flight: int = Field(
        16, ge=1, le=1024, description="pages of one document rendered and working at once "
        "(bounds the router's memory per document)")
    encoder_cache_mb: int = Field(
        512, ge=0, le=65_536, description="router cache of encoded images (repeated pages skip "
        "the GPU); 0: off")
    max_inflight_requests: int | None = Field(
        None, ge=1, le=100_000, description="requests one Router replica works on; more get HTTP "
        "503; none: what the decoders hold (max_batch + decoder_queue of each model), so one "
        "Router can keep them full")
    request_timeout_s: float = Field(
        600, gt=0, le=3600, description="a request's time limit (HTTP 408), unless it sets timeout_s")
    served_model_name: str | None = Field(
        None, min_length=1, description="the model id of `/v1/models` and chat requests' `model`; "
        "none: the checkpoint directory's name")
    fetch_image_urls: bool = Field(
        False, description="chat image parts may be http(s) URLs, fetched by the router within "
        "max_request_mb and fetch_timeout_s")
    fetch_timeout_s: float = Field(10, gt=0, le=300, description="time limit of one image URL fetch")
    allowed_media_domains: list[str] | None = Field(
        None, description="with fetch_image_urls, image URLs' hosts must be one of these domains or "
        "their subdomains (vLLM's option of that name); none: any public host")
    fetch_private_addresses: bool = Field(
        False, description="with fetch_image_urls, image URLs may resolve to loopback, private and "
        "link-local addresses (by default refused, after name resolution and on every redirect)")
    allowed_local_media_path: str | None = Field(
        None, description="chat image parts may be file:// URLs under this directory (on the router's node)")
    api_key: str | None = Field(
        None, min_length=8, description="when set, every route but /health needs "
        "`Authorization: Bearer <key>`")
    batch_store: str = Field(
        "~/.deepseek-ocr/batches.db", description="batch jobs' state (OpenAI's Batch API): a SQLite "
        "file, or a postgresql:// URL (a cluster's: every Router replica sees the same batches)")
    batch_files: str = Field(
        "~/.deepseek-ocr/batch-files", description="uploaded and answer files' bytes: a directory, "
        "or a URI pyarrow opens (s3://bucket/prefix) for a cluster")
    batch_file_mb: int = Field(
        200, ge=1, le=2048, description="largest batch input file (OpenAI's limit; HTTP 413 above)")
    batch_lines_in_flight: int = Field(
        256, ge=1, le=4096, description="batch jobs' lines each Router replica has in the app at once "
        "(they run below interactive requests, so enough to fill a decoder's batch)")
    batch_lease_s: float = Field(
        30.0, ge=1, le=3600, description="how long a batch stays its Router replica's without renewal "
        "(renewed every third of it): a replica that dies holding one, another takes it on this long after")
    gpu_memory_fraction_global: float | None = Field(
        None, gt=0, le=1, description="GlobalEncoder's cap of its GPU's memory (shared GPUs)")
    gpu_memory_fraction_local: float | None = Field(
        None, gt=0, le=1, description="LocalEncoder's cap of its GPU's memory (shared GPUs)")
    gpu_memory_fraction_decoder: float | None = Field(
        None, gt=0, le=1, description="Decoder's cap of its GPU's memory (shared GPUs)")
    models: list[dict] | None = Field(
        None, description="several models behind one address: each entry a `name` and the "
        "arguments of this table that are the model's own (`checkpoint`, placement, batch and "
        "memory settings; MODEL_ARGUMENTS), the rest taken from the app's; each model gets its own "
        "tiers (`GlobalEncoder-<name>`...), requests choose by `model` (default: the first)")

    def served_models(self) -> list[ServedModel]:
        """Each served model with its own config: one per `models` entry (its name its
        `served_model_name`), or this config alone."""
        if not self.models:
            return [ServedModel(self, several=False)]
        shared = self.model_dump(exclude={"models"})
        return [ServedModel(AppConfig(**{**shared, **{k: v for k, v in entry.items() if k != "name"},
                                         "served_model_name": entry["name"]}), several=True)
                for entry in self.models]

    def inflight_limit(self) -> int:
        """Requests one Router replica works on (`max_inflight_requests`)."""
        if self.max_inflight_requests is not None:
            return self.max_inflight_requests
        return sum(model.config.max_batch + model.config.decoder_queue
                   for model in self.served_models())

    def gpu_memory_fraction(self, deployment: str) -> float | None:
        """The cap of "global", "local", "decoder", or "both" (one_encoder: the two encoders'
        caps together)."""
        if deployment == "both":
            parts = [self.gpu_memory_fraction_global, self.gpu_memory_fraction_local]
            return sum(p for p in parts if p) or None
        return getattr(self, f"gpu_memory_fraction_{deployment}")

    @model_validator(mode="after")
    def _models_name_their_own_arguments(self):
        if self.models is None:
            return self
        if not self.models:
            raise ValueError("models: give at least one model, or leave it out")
        names = []
        for i, entry in enumerate(self.models):
            name = entry.get("name")
            if not isinstance(name, str) or not MODEL_NAME.fullmatch(name):
                raise ValueError(f"models[{i}].name must be a name of letters, digits, '.', '_' "
                                 f"or '-' (at most 64), got {name!r}")
            if name in names:
                raise ValueError(f"models[{i}].name {name!r} is given twice")
            names.append(name)
            foreign = sorted(set(entry) - MODEL_ARGUMENTS - {"name"})
            if foreign:
                raise ValueError(f"models[{i}] ({name}): {', '.join(foreign)} "
                                 f"{'is not an argument' if len(foreign) == 1 else 'are not arguments'} "
                                 f"a model sets; a model sets {', '.join(sorted(MODEL_ARGUMENTS))}")
        if self.served_model_name is not None:
            raise ValueError("served_model_name names the one model; with models, each entry's "
                             "name is its id")
        for i, entry in enumerate(self.models):  # each model's arguments, checked now
            try:
                AppConfig(**{**self.model_dump(exclude={"models"}),
                             **{k: v for k, v in entry.items() if k != "name"}})
            except ValidationError as e:
                reasons = "; ".join(f"{'.'.join(map(str, error['loc'])) or 'value'}: "
                                    f"{error['msg'].removeprefix('Value error, ')}" for error in e.errors())
                raise ValueError(f"models[{i}] ({entry['name']}): {reasons}") from None
        return self

    @model_validator(mode="after")
    def _one_engine_makes_the_views(self):
        for name in ("one_encoder", "encoder_in_router"):
            if getattr(self, name) and not self.views_on_encoder:
                raise ValueError(f"{name} needs views_on_encoder: one engine makes both paths' "
                                 f"views from the decoded image")
        return self


# What a `models` entry may set: the arguments that belong to one model's tiers. The rest (keys,
# limits, admission, fetching) are the app's, shared by every model.
MODEL_ARGUMENTS = frozenset({
    "checkpoint", "encode_only", "use_graphs", "max_images", "max_graph_memory_gb", "max_batch",
    "decoder_queue", "kv_cache_gb", "kv_cache_dtype", "max_len", "one_encoder", "encoder_in_router", "views_on_encoder",
    "decode_on_encoder", "views_on_arrival", "encoder_decode_threads", "encoder_cache_mb",
    "gpu_memory_fraction_global", "gpu_memory_fraction_local", "gpu_memory_fraction_decoder"})


@dataclass(frozen=True)
class ServedModel:
    """One model the app serves, with its own config; `several`: one of several models, whose
    tiers' deployment names carry its name."""

    config: AppConfig
    several: bool

    @property
    def name(self) -> str | None:
        return self.config.served_model_name

    def tier_name(self, tier: str) -> str:
        """`Decoder` for the one model, `Decoder-<name>` for one of several."""
        return f"{tier}-{self.name}" if self.several else tier

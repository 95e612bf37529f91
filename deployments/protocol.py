"""What crosses the app's boundaries: the request options (validated in one place) and tensors on
the wire between deployments.

`OcrOptions` is the one options object of a request, for HTTP (JSON or multipart) and Python
handle calls alike. Its limits are the libraries' own: the view options are checked by
`encoder.preprocess.check_view_options`, the sampling options by `SamplingParams` and
`NGramConfig`, so each rule and its message exist once; a bad value raises `BadRequest` (HTTP
400) naming the field.
"""
from __future__ import annotations

import contextvars
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import pydantic
import torch
from pydantic import BaseModel, ConfigDict, Field

from decoder import NGramConfig, RepetitionGuard, SamplingParams
from decoder.config import DecoderArgs
from decoder.engine import MAX_TEMPERATURE
from decoder.tokenizer import PROMPT_PRESETS, count_image_tags
from documents import DEFAULT_DPI, MAX_DPI, MIN_DPI, DocumentError
from encoder import ImageError
from encoder.preprocess import DEFAULT_MAX_CROPS, MODES, check_view_options

# Generated tokens per request: at most the model's context.
MAX_NEW_TOKENS = DecoderArgs().max_positions


MAX_STOP_STRINGS = 16


class BadRequest(ValueError):
    """A request the caller must fix (HTTP 400); the message names the field or the problem,
    `param` the field when there is one."""

    status = 400

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


# What the caller must fix (HTTP 4xx): a bad option, image or PDF. Never a replica's fault: never
# logged as one (`replica_logs`).
CLIENT_ERRORS = (BadRequest, ImageError, DocumentError)


class NotFound(BadRequest):
    status = 404


class PayloadTooLarge(BadRequest):
    status = 413


class UnsupportedMediaType(BadRequest):
    status = 415


# When the HTTP request being answered arrived: its `total_ms` counts from there. (Here, not in
# router.py: `serve.ingress` pickles the Router's endpoints with their module's globals by value,
# and a ContextVar cannot be pickled.)
REQUEST_ARRIVED: contextvars.ContextVar[float | None] = contextvars.ContextVar("arrived", default=None)


class Images(list):
    """A request's images (bytes, or whatever a handle call sent), with the request field each
    came in (`fields`: `image`, `images[1]`, `messages[0].content[2]`), so that an error about
    one image names its field."""

    def __init__(self, images=(), fields: list[str] | None = None):
        super().__init__(images)
        self.fields = fields


def replica_error(error: BaseException) -> BaseException:
    """The exception a replica raised, without Ray's wrapper: a `RayTaskError` is also an
    instance of its cause's class (so `except ImageError` catches it), but its text names the
    replica's actor, process, address and object, in colour; clients must see only the cause."""
    from ray.exceptions import RayTaskError
    while isinstance(error, RayTaskError) and isinstance(getattr(error, "cause", None), BaseException):
        error = error.cause
    return error


@dataclass(frozen=True)
class Document:
    """A request's PDF: its bytes, or (handle calls) a path on the router's node."""
    data: bytes | str | os.PathLike


class NGramOptions(BaseModel):
    """The no-repeat-n-gram rule of one request; what it leaves unset is the served model's own
    rule (`decoder.ngram_defaults`: DeepSeek-OCR's 30 over 90 generated tokens, table tags
    exempt; Unlimited-OCR's 35 over 128 tokens, 1,024 for several pages, prompt included)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = True
    ngram_size: int | None = None
    window: int | None = None  # default: the model's, or ngram_size where that is larger
    whitelist: list[int] | None = None

    def config(self, default: NGramConfig = NGramConfig()) -> NGramConfig:
        if not self.enabled:
            return NGramConfig.off()
        size = self.ngram_size or default.ngram_size
        return NGramConfig(size, self.window or max(default.window, size),
                           default.whitelist if self.whitelist is None else tuple(self.whitelist),
                           include_prompt=default.include_prompt)


class RepetitionGuardOptions(BaseModel):
    """The loop detector of one request (`decoder.RepetitionGuard`: its defaults, its limits);
    `{"enabled": false}` turns it off."""

    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = RepetitionGuard.enabled
    min_tokens: int = RepetitionGuard.min_tokens
    varied_tokens: int = RepetitionGuard.varied_tokens
    max_period: int = RepetitionGuard.max_period
    similarity: float = RepetitionGuard.similarity
    min_repeats: int = RepetitionGuard.min_repeats

    def config(self) -> RepetitionGuard:
        return RepetitionGuard(**self.model_dump())


MAX_RETRIES = 8


class RetryOptions(BaseModel):
    """A page that loops (`finish_reason` "repetition"; with `on_length` also one that ran to
    max_tokens) is generated again at each of `temperatures` in turn, seeded (the request's
    seed, else 0, plus the attempt's number: a rerun gives the same answer), until an attempt
    ends cleanly; `[]` turns retries off."""

    model_config = ConfigDict(extra="forbid", strict=True)
    temperatures: list[float] = Field([0.3, 0.6], max_length=MAX_RETRIES)
    on_length: bool = False

    @pydantic.field_validator("temperatures")
    @classmethod
    def _in_range(cls, temperatures: list[float]) -> list[float]:
        for t in temperatures:
            if not 0 < t <= MAX_TEMPERATURE:
                raise ValueError(f"each retry temperature must be in (0, {MAX_TEMPERATURE}], got {t}")
        return temperatures


class OcrOptions(BaseModel):
    """Everything a request may set besides its images. Unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    prompt: str | None = None  # default: one <image> tag per image + DeepSeek's markdown prompt
    prompt_preset: str | None = None  # one of PROMPT_PRESETS, instead of a prompt
    ref: str | None = None  # what to find, with prompt_preset "locate"
    output_format: Literal["text", "markdown", "blocks"] = "text"
    mode: str = "gundam"
    max_crops: int = DEFAULT_MAX_CROPS
    max_tokens: int = Field(MAX_NEW_TOKENS, ge=1, le=MAX_NEW_TOKENS)
    stop: str | list[str] = []
    ngram: NGramOptions = NGramOptions()
    repetition_guard: RepetitionGuardOptions = RepetitionGuardOptions()  # loops end as "repetition"
    retry: RetryOptions = RetryOptions()  # such pages generated again (not streams: sent text stays sent)
    # documents: a page whose every attempt failed (looped, errored) answers with its PDF text layer
    text_layer_fallback: bool = True
    temperature: float = Field(0.0, ge=0, le=MAX_TEMPERATURE)  # greedy by default
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    skip_special_tokens: bool = False  # true drops the grounding tags from the text
    return_crops: bool = False  # with output_format "blocks": JPEG crops of the image blocks
    page_range: str | None = None  # documents: marker's "0,5-10,20" (0-based); none: every page
    dpi: int = Field(DEFAULT_DPI, ge=MIN_DPI, le=MAX_DPI)  # documents: page rendering
    stream: bool = False
    timeout_s: float | None = Field(None, gt=0, le=3600)  # default: the app's request_timeout_s
    # "batch": generated below interactive requests (what batch jobs' lines run as): it waits
    # while interactive work runs and fills what that leaves
    priority: Literal["interactive", "batch"] = "interactive"
    model: str | None = None  # which served model (GET /v1/models); default: the app's first
    # documents: pages sent together as one multi-page request (Unlimited-OCR), the answer split
    # per page where the model marks it (<PAGE>)
    pages_per_request: int = Field(1, ge=1, le=64)

    @pydantic.model_validator(mode="after")
    def _check(self):
        """Rules across fields; each error names the field a client fixes (`FieldError`)."""
        with about("mode" if self.mode not in MODES else "max_crops"):
            check_view_options(self.mode, self.max_crops)
        with about("prompt_preset"):
            if self.prompt_preset is not None:
                if self.prompt is not None:
                    raise ValueError("send prompt or prompt_preset, not both")
                if self.prompt_preset not in PROMPT_PRESETS:
                    raise ValueError(f"unknown prompt_preset {self.prompt_preset!r}; presets: "
                                     f"{', '.join(PROMPT_PRESETS)}")
        with about("ref"):
            if (self.prompt_preset == "locate") != (self.ref is not None):
                raise ValueError("ref (what to locate) goes with prompt_preset 'locate', and only with it")
        with about("return_crops"):
            if self.return_crops and self.output_format != "blocks":
                raise ValueError("return_crops goes with output_format 'blocks'")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        with about("stop"):
            if len(stops) > MAX_STOP_STRINGS:
                raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        for name, text in [("prompt", self.prompt or ""), ("ref", self.ref or ""),
                           *(("stop", s) for s in stops)]:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate (JSON allows "\ud800")
                raise FieldError(name, f"{name} is not valid Unicode (lone surrogate at {e.start})") from None
        with about("ngram"):
            self.ngram.config()
        with about("repetition_guard"):
            self.repetition_guard.config()
        with about("stop"):
            self.sampling()
        return self

    @classmethod
    def parse(cls, options: dict, *, strict: bool = True) -> OcrOptions:
        """`options` as sent; `strict=False` for multipart forms, whose values are all strings."""
        return validate(cls, options, strict=strict)

    def sampling(self, ngram_default: NGramConfig = NGramConfig()) -> SamplingParams:
        """The decoder's parameters; `ngram_default`: the served model's rule for this request
        (what `ngram` leaves unset)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return SamplingParams(max_tokens=self.max_tokens, stop=stop, ngram=self.ngram.config(ngram_default),
                              repetition=self.repetition_guard.config(),
                              temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                              skip_special_tokens=self.skip_special_tokens, priority=self.priority)

    def prompt_for(self, n_images: int, max_images: int, default_preset: str = "markdown") -> str:
        """The prompt for `n_images` images (the model's default preset, or the caller's prompt
        with one <image> tag per image); BadRequest when the count is outside 1..max_images or
        tags disagree."""
        if n_images == 0:
            raise BadRequest("no image given (send 'image' as a file upload or base64 JSON)", "image")
        if n_images > max_images:
            raise BadRequest(f"at most {max_images} images per request, got {n_images}", "images")
        if self.prompt is None:  # a preset (the markdown one by default), one tag per image
            preset = PROMPT_PRESETS[self.prompt_preset or default_preset].format(ref=self.ref)
            return "<image>" * n_images + preset.removeprefix("<image>")
        if count_image_tags(self.prompt) != n_images:
            raise BadRequest(f"prompt must contain one <image> tag per image: it has "
                             f"{count_image_tags(self.prompt)}, the request has {n_images} image(s)",
                             "prompt")
        return self.prompt


class FieldError(ValueError):
    """A rule across fields broken, about `field`: pydantic gives a model-level error no
    location, so `validate` takes the field from here."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@contextmanager
def about(field: str):
    """A ValueError raised inside is about `field` (a FieldError)."""
    try:
        yield
    except FieldError:
        raise
    except ValueError as e:
        raise FieldError(field, str(e)) from None


def validate(model: type[BaseModel], data, strict: bool = True):
    """`model` validated from `data`; BadRequest naming every error, `param` the first field."""
    if not isinstance(data, dict):
        raise BadRequest("JSON body must be an object")
    try:
        return model.model_validate(data, strict=strict)
    except pydantic.ValidationError as e:
        errors = e.errors()
        cause = errors[0].get("ctx", {}).get("error")
        param = (".".join(str(part) for part in errors[0]["loc"])
                 or getattr(cause, "field", None))
        raise BadRequest("; ".join(describe_error(error) for error in errors), param) from None


def describe_error(error: dict) -> str:
    field = ".".join(str(part) for part in error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unknown field"
    return f"{field}: {message}" if field else message


# -- tensors between deployments ----------------------------------------------------------------
# One format: torch tensors as their raw bytes, out of band (`send_tensors_out_of_band`, called by
# every replica process); a tensor on a GPU is first copied to the host (`to_host`).


def to_host(tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each tensor on the host (None stays None), those on a GPU copied together: into pinned
    buffers (torch's caching host allocator reuses them once sent), queued on the current
    stream, then one wait. One `.to("cpu")` per tensor would allocate pageable memory and wait
    for the device once per request of a batch."""
    on_gpu = [t for t in tensors if t is not None and t.is_cuda]
    host = {id(t): torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for t in on_gpu}
    for device in {t.device for t in on_gpu}:
        torch.cuda.current_stream(device).synchronize()
    return [None if t is None else host.get(id(t), t) for t in tensors]


def send_tensors_out_of_band() -> None:
    """From now on this process's Ray calls and results carry torch tensors as their raw bytes
    (a uint8 numpy view: pickle5 out-of-band, one copy into the object store, read in place by
    the receiver) instead of torch's own pickling (torch.save into in-band bytes and torch.load:
    ~10 ms more per 2.3 MB sequence, ray-serve.md 5.2). The receiver needs no registration: the
    rebuilding function travels by value. It gets a CPU tensor of the same dtype and shape over
    the object's shared memory (written to only by the caller that owns the result)."""
    import ray

    def raw(t: torch.Tensor):
        if t.layout != torch.strided or t.is_quantized:
            raise TypeError(f"send_tensors_out_of_band sends strided tensors, not {t.layout} / quantized")
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        return flat.view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape)

    def tensor(sent):  # defined here, not at module level, so that it pickles by value
        import warnings as warnings_module

        import torch as torch_module
        array, dtype, shape = sent
        with warnings_module.catch_warnings():
            warnings_module.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch_module.from_numpy(array)
        return t.view(getattr(torch_module, dtype)).reshape(shape)

    ray.util.register_serializer(torch.Tensor, serializer=raw, deserializer=tensor)

"""OpenAI's chat-completions API on top of the OCR request path: what a chat request means here,
and the shapes of what goes back. No model code: a chat request becomes the same images +
`OcrOptions` a `/v1/ocr` request does, and the Router runs both through one pipeline.

The prompt is built as vLLM builds it for DeepSeek-OCR (its `template_deepseek_ocr.jinja` and
chat utilities): the system message's text, then the user message's parts: one `<image>`
placeholder per image that the text does not already place, FIRST, then the text parts, all
joined by "\\n"; no role tags. So `[image, "Free OCR."]` is exactly `<image>\\nFree OCR.`.

DeepSeek's repetition rule is on by default here (30/90 with the `<td>` whitelist); a request
that sends vLLM's `vllm_xargs` gets vLLM's meaning of them instead: `ngram_size` turns the rule on
(absent: off), `window_size` defaults to 100 and `whitelist_token_ids` to none.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from decoder.tokenizer import IMAGE_TOKEN, count_image_tags

from . import pages
from .config import AppConfig
from .media import decode_data_url, read_image_url
from .protocol import BadRequest, Document, Images, OcrOptions, validate

VLLM_WINDOW_DEFAULT = 100  # vLLM's NoRepeatNGramLogitsProcessor default window
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageURL(_Strict):
    url: str
    detail: str | None = None  # OpenAI's resolution hint: the model's own tiling decides here


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class FileData(_Strict):
    file_data: str | None = None  # data:application/pdf;base64,...
    file_id: str | None = None
    filename: str | None = None


class FilePart(_Strict):
    """A PDF, as OpenAI's clients send files: every page is OCR'd with the message's prompt."""
    type: Literal["file"]
    file: FileData


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart | ImagePart | FilePart]
    name: str | None = None


class VllmXargs(_Strict):
    ngram_size: int | None = None
    window_size: int | None = None
    whitelist_token_ids: list[int] | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatRequest(_Strict):
    messages: list[Message] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    # vLLM's extras, as its users send them in extra_body
    skip_special_tokens: bool = False
    vllm_xargs: VllmXargs | None = None
    # this app's extensions (the /v1/ocr options of the same names)
    mode: str | None = None
    max_crops: int | None = None
    prompt_preset: str | None = None
    ref: str | None = None
    output_format: str | None = None
    return_crops: bool | None = None
    timeout_s: float | None = None
    repetition_guard: dict | None = None
    retry: dict | None = None
    text_layer_fallback: bool | None = None

    @classmethod
    def parse(cls, body) -> ChatRequest:
        return validate(cls, body, strict=False)  # lax as OpenAI's own: a JSON 0 is a float 0.0

    def sources_and_prompt(self) -> tuple[list[str], str | None, str | None]:
        """The image URLs in order, the PDF's data (a `file` part's base64 or data: URL), and
        the prompt text as vLLM builds it (None with a preset); a PDF's pages each count as
        the one image of the prompt."""
        system = [m for m in self.messages if m.role == "system"]
        users = [m for m in self.messages if m.role == "user"]
        if len(users) != 1 or len(system) > 1 or len(system) + len(users) != len(self.messages):
            raise BadRequest("send one user message (with the image), optionally after one "
                             "system message: DeepSeek-OCR is not a multi-turn chat model", "messages")
        if system and not isinstance(system[0].content, str):
            if any(not isinstance(p, TextPart) for p in system[0].content):
                raise BadRequest("images and files go in the user message, not the system "
                                 "message", "messages")
        content = users[0].content
        parts = [TextPart(type="text", text=content)] if isinstance(content, str) else content
        urls = [p.image_url.url for p in parts if isinstance(p, ImagePart)]
        files = [p.file for p in parts if isinstance(p, FilePart)]
        if files and (urls or len(files) > 1):
            raise BadRequest("send one file (a PDF) or images, not both", "messages")
        if files and files[0].file_data is None:
            raise BadRequest("file parts must carry file_data (a base64 PDF): this server has no "
                             "files API for file_id", "messages")
        document = files[0].file_data if files else None
        text = "\n".join(p.text for p in parts if isinstance(p, TextPart))
        if self.prompt_preset is not None:  # the preset is the whole prompt
            if text.strip() or system:
                raise BadRequest("prompt_preset is the whole prompt: send the image without text "
                                 "or system message, or send a prompt without prompt_preset",
                                 "prompt_preset")
            return urls, document, None
        missing = max(len(urls), 1 if files else 0) - count_image_tags(text)
        prompt = "\n".join([IMAGE_TOKEN] * missing + [text]) if missing > 0 else text
        return urls, document, _text_of(system[0]) + prompt if system else prompt

    def image_fields(self) -> list[str]:
        """Where each image URL of `sources_and_prompt` is in the request, in the same order
        (`messages[1].content[0]`): an error about one image names it."""
        return [f"messages[{m}].content[{c}]" for m, message in enumerate(self.messages)
                if message.role == "user" and not isinstance(message.content, str)
                for c, part in enumerate(message.content) if isinstance(part, ImagePart)]

    def ocr_options(self, prompt: str | None) -> OcrOptions:
        """The `/v1/ocr` options this request means (`prompt` None: its preset's prompt)."""
        if self.n != 1:
            raise BadRequest("only n = 1 is supported", "n")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise BadRequest("max_tokens and max_completion_tokens disagree: send one", "max_tokens")
        options = {"prompt": prompt, "stop": self.stop, "stream": self.stream,
                   "max_tokens": self.max_completion_tokens or self.max_tokens,
                   "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                   "skip_special_tokens": self.skip_special_tokens, "mode": self.mode,
                   "max_crops": self.max_crops, "prompt_preset": self.prompt_preset, "ref": self.ref,
                   "output_format": self.output_format, "return_crops": self.return_crops,
                   "timeout_s": self.timeout_s, "model": self.model, "repetition_guard": self.repetition_guard,
                   "retry": self.retry, "text_layer_fallback": self.text_layer_fallback}
        if self.vllm_xargs is not None:
            x = self.vllm_xargs
            options["ngram"] = {"enabled": False} if not x.ngram_size else {
                "ngram_size": x.ngram_size, "window": x.window_size or VLLM_WINDOW_DEFAULT,
                "whitelist": x.whitelist_token_ids or []}
        return OcrOptions.parse({k: v for k, v in options.items() if v is not None})


def _text_of(message: Message) -> str:
    if isinstance(message.content, str):
        return message.content
    return "\n".join(p.text for p in message.content)


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(result: dict) -> dict:
    return {"prompt_tokens": result["prompt_tokens"], "completion_tokens": result["completion_tokens"],
            "total_tokens": result["prompt_tokens"] + result["completion_tokens"]}


def completion(request_id: str, model: str, ocr: dict) -> dict:
    """A `chat.completion` from a `/v1/ocr` answer (its extensions kept beside the choice)."""
    body = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": ocr["text"]},
                         "finish_reason": FINISH_REASONS.get(ocr["finish_reason"], ocr["finish_reason"]),
                         "logprobs": None}],
            "usage": {**usage(ocr["usage"]), "image_tokens": ocr["usage"]["image_tokens"]}}
    for extension in ("warning", "blocks", "pages", "failed_pages", "repetition"):
        if extension in ocr:
            body[extension] = ocr[extension]
    return body


def chunk(request_id: str, model: dict, created: int, delta: dict | None,
          finish_reason: str | None = None, usage_: dict | None = None,
          include_usage: bool = False) -> dict:
    """One `chat.completion.chunk`; `delta` None is the usage chunk (no choices); `model`: the
    model's fields of every answer (its id, any warning)."""
    body = {"id": request_id, "object": "chat.completion.chunk", "created": created, **model,
            "choices": [] if delta is None else
            [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}
    if include_usage:
        body["usage"] = usage_
    return body


def model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "deepseek-ocr-serve"}


# -- a chat request through the OCR pipeline ----------------------------------------------------
async def read_chat(body, config: AppConfig) -> tuple[Images | Document, OcrOptions, ChatRequest]:
    """A chat request -> (its images, each named by its place in the messages, or its PDF; the
    OCR options it means; the request). Image URLs are read within the operator's rules."""
    chat = ChatRequest.parse(body)
    urls, document, prompt = chat.sources_and_prompt()
    options = chat.ocr_options(prompt)
    if document is not None:
        return Document(decode_data_url(document, "document", "messages")), options, chat
    if not urls:
        raise BadRequest("the user message has no image: add an image_url part (a data: URL) "
                         "or a file part (a PDF)", "messages")
    if len(urls) > config.max_images_per_request:
        raise BadRequest(f"at most {config.max_images_per_request} images per request: the "
                         f"user message has {len(urls)} image_url parts", "messages")
    tags = count_image_tags(options.prompt) if options.prompt is not None else len(urls)
    if tags != len(urls):
        raise BadRequest(f"the messages' text has {tags} <image> tags for {len(urls)} image_url "
                         f"parts: leave the tags out (one is placed per image) or place one "
                         f"per image", "messages")
    limits = dict(max_bytes=config.max_request_mb << 20, fetch=config.fetch_image_urls,
                  timeout_s=config.fetch_timeout_s, local_root=config.allowed_local_media_path,
                  allowed_domains=tuple(config.allowed_media_domains or ()) or None,
                  allow_private=config.fetch_private_addresses)

    async def read(url: str, field: str) -> bytes:
        try:
            return await read_image_url(url, **limits)
        except BadRequest as e:  # named by where it is in the chat request
            e.param = field
            raise
    fields = chat.image_fields()
    images = await asyncio.gather(*(read(url, field) for url, field in zip(urls, fields)))
    return Images(images, fields), options, chat


async def answer(pipeline, source: Images | Document, options: OcrOptions) -> dict:
    """A `chat.completion` of the OCR of `source` (a document's pages joined)."""
    if isinstance(source, Document):
        document = await pipeline.document(source, options)
        ocr = {**document, "finish_reason": pages.finish_reason(document["pages"])}
    else:
        ocr = await pipeline.ocr(source, options)
    return completion(completion_id(), ocr["model"], ocr)


async def deltas(pipeline, source: Images | Document, options: OcrOptions) -> AsyncIterator[dict]:
    """The decoder's deltas of an image request; a document's pages as deltas, one a page."""
    if isinstance(source, Document):
        return pages.as_deltas(await pipeline.document_pages(source, options))
    return await pipeline.ocr_stream(source, options)


async def chunks(deltas: AsyncIterator[dict], model: dict, include_usage: bool) -> AsyncIterator[dict]:
    """The OCR deltas as `chat.completion.chunk`s: the assistant role first, content deltas,
    the finish reason, then (when asked) a usage chunk."""
    request_id, created = completion_id(), int(time.time())

    def one(delta, finish_reason=None, usage_=None):
        return chunk(request_id, model, created, delta, finish_reason, usage_, include_usage)
    yield one({"role": "assistant", "content": ""})
    async for delta in deltas:
        if delta["text"]:
            yield one({"content": delta["text"]})
        if delta["finished"]:
            reason = delta["finish_reason"]
            yield one({}, FINISH_REASONS.get(reason, reason))
            if include_usage:
                yield one(None, usage_=usage(delta))

"""Tokenizers for DeepSeek-OCR, its prompt format, streaming detokenisation and stop strings.

Two tokenizers share one small interface (`encode`, `decode`, `bos_id`, `eos_id`, `vocab_size`,
`name`, `is_random`):

* `HFTokenizer` reads a checkpoint's `tokenizer.json` with the `tokenizers` library;
* `ByteTokenizer` is the default when there is no checkpoint: the tiny random model has no real
  vocabulary, so text is encoded as UTF-8 bytes, keeping DeepSeek-OCR's special-token ids.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 128815
# The BOS/EOS/PAD strings use full-width bars (U+FF5C) and U+2581, as in DeepSeek's vocabulary.
SPECIAL_TOKENS = {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<｜▁pad▁｜>": 2,
                  "<image>": 128815, "<|ref|>": 128816, "<|/ref|>": 128817, "<|det|>": 128818,
                  "<|/det|>": 128819, "<|grounding|>": 128820, "<td>": 128821, "</td>": 128822,
                  "<tr>": 128823, "</tr>": 128824, "<|User|>": 128825, "<|Assistant|>": 128826}
TD_ID, TD_CLOSE_ID = 128821, 128822
VOCAB_SIZE = 129280  # DeepSeek-OCR's embedding rows; the tiny random model keeps it

_REPLACEMENT_CHAR = "\ufffd"


class HFTokenizer:
    """DeepSeek-OCR's own tokenizer, loaded from a `tokenizer.json`."""

    name = "tokenizer.json"
    is_random = False

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer  # only needed when a checkpoint is served

        self._tokenizer = Tokenizer.from_file(str(path))
        image_id = self._tokenizer.token_to_id(IMAGE_TOKEN)
        if image_id != IMAGE_TOKEN_ID:
            raise ValueError(f"{path} is not DeepSeek-OCR's tokenizer: {IMAGE_TOKEN} maps to "
                             f"{image_id}, expected {IMAGE_TOKEN_ID}")

    @property
    def bos_id(self) -> int:
        return BOS_ID

    @property
    def eos_id(self) -> int:
        return EOS_ID

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids tokenizer.json marks special (what `skip_special_tokens` drops)."""
        return frozenset(i for i, token in self._tokenizer.get_added_tokens_decoder().items()
                         if token.special)

    def encode(self, text: str) -> list[int]:
        # Added tokens written in the text (e.g. "<|grounding|>") still map to their ids.
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


class ByteTokenizer:
    """UTF-8 bytes as ids 3..258, DeepSeek-OCR's special tokens at their real ids.

    Any other id (the random model may emit any id of the vocabulary) decodes to a visible
    placeholder `<|id:N|>`, so nothing is silently dropped.
    """

    name = "byte-level (tiny random model)"
    is_random = True
    vocab_size = VOCAB_SIZE
    bos_id = BOS_ID
    eos_id = EOS_ID
    BYTE_OFFSET = 3
    special_ids = frozenset(SPECIAL_TOKENS.values())  # as its tokenizer.json marks them

    # Longest first, so a special token that is a prefix of another cannot shadow it.
    _SPECIAL_RE = re.compile("|".join(re.escape(s) for s in sorted(SPECIAL_TOKENS, key=len,
                                                                   reverse=True)))
    _SPECIAL_BY_ID = {i: s for s, i in SPECIAL_TOKENS.items()}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        for match in self._SPECIAL_RE.finditer(text):
            ids += self._encode_bytes(text[pos:match.start()])
            ids.append(SPECIAL_TOKENS[match.group()])
            pos = match.end()
        ids += self._encode_bytes(text[pos:])
        return ids

    def _encode_bytes(self, text: str) -> list[int]:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"text is not valid Unicode (lone surrogate at {e.start})") from None
        return [self.BYTE_OFFSET + b for b in data]

    def decode(self, ids: list[int]) -> str:
        parts: list[str] = []
        pending = bytearray()  # a run of byte ids is decoded together: characters span ids
        for i in ids:
            if self.BYTE_OFFSET <= i < self.BYTE_OFFSET + 256:
                pending.append(i - self.BYTE_OFFSET)
                continue
            if pending:
                parts.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            parts.append(self._SPECIAL_BY_ID.get(i, f"<|id:{i}|>"))
        if pending:
            parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)


def load_tokenizer(path: str | os.PathLike | None) -> HFTokenizer | ByteTokenizer:
    """None -> the byte-level tokenizer of the tiny random model; a checkpoint directory (or its
    `tokenizer.json` itself) -> DeepSeek-OCR's tokenizer."""
    if path is None:
        return ByteTokenizer()
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no tokenizer.json at {file}")
    return HFTokenizer(file)


def byte_tokenizer_json() -> str:
    """A `tokenizer.json` that encodes exactly as `ByteTokenizer`: a byte-level BPE with no merges
    (byte b -> id 3 + b) and DeepSeek-OCR's special tokens at their real ids. Random checkpoints
    carry it, so the real tokenizer loading path serves them."""
    import json

    vocab = {char: ByteTokenizer.BYTE_OFFSET + b for b, char in _gpt2_byte_chars().items()}
    vocab.update(SPECIAL_TOKENS)
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for s, i in SPECIAL_TOKENS.items()]
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }, ensure_ascii=False)


def _gpt2_byte_chars() -> dict[int, str]:
    """The printable character ByteLevel pre-tokenisation maps each byte to (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


# -- prompts: BOS, then the text with each `<image>` tag replaced by a run of image placeholder
# ids (one per image embedding), no role tags and no EOS.
DEFAULT_PROMPT = "<image>\n<|grounding|>Convert the document to markdown."
# DeepSeek's own prompts (its README and config), by the names the API offers. `locate` takes the
# object to find as `ref`.
PROMPT_PRESETS = {
    "markdown": DEFAULT_PROMPT,
    "ocr": "<image>\n<|grounding|>OCR this image.",
    "free": "<image>\nFree OCR.",
    "figure": "<image>\nParse the figure.",
    "describe": "<image>\nDescribe this image in detail.",
    "locate": "<image>\nLocate <|ref|>{ref}<|/ref|> in the image.",
    # Unlimited-OCR's (its README): one page, and several pages in one request (one <image> per
    # page, in base mode), its answer split by <PAGE> marks.
    "parse": "<image>document parsing.",
    "parse_pages": "<image>Multi page parsing.",
}


def default_preset(family: str, num_images: int) -> str:
    """The prompt preset a request without a prompt gets from its model: DeepSeek-OCR's
    markdown conversion, or Unlimited-OCR's document parsing (of one page or of several)."""
    if family == "unlimited-ocr":
        return "parse" if num_images <= 1 else "parse_pages"
    return "markdown"


def count_image_tags(prompt: str) -> int:
    return prompt.count(IMAGE_TOKEN)


def build_prompt(tokenizer, prompt: str, image_token_counts: list[int]) -> list[int]:
    """Token ids of `prompt`, its i-th `<image>` tag expanded to `image_token_counts[i]`
    placeholder ids (the number of embeddings the encoder makes for image i)."""
    chunks = prompt.split(IMAGE_TOKEN)
    tags, images = len(chunks) - 1, len(image_token_counts)
    if tags != images:
        raise ValueError(f"prompt has {tags} {IMAGE_TOKEN} tag{'' if tags == 1 else 's'} but "
                         f"{images} image{' was' if images == 1 else 's were'} given")
    for count in image_token_counts:
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise ValueError(f"image token counts must be positive ints, got {count!r}")
    ids = [BOS_ID]
    for i, chunk in enumerate(chunks):
        if i:
            ids += [IMAGE_TOKEN_ID] * image_token_counts[i - 1]
        if chunk:
            ids += tokenizer.encode(chunk)
    return ids


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas, never splitting a UTF-8 character.

    The concatenation of all deltas plus `flush()` equals `tokenizer.decode(all_ids)` for
    tokenizers whose decoding is byte-level (DeepSeek's, `ByteTokenizer`) or per-token.
    Each step decodes only a short window: ids[prefix:] against ids[prefix:read], where `read` is
    the end of what was emitted and `prefix` the one step before it. Decoding with a token of
    context keeps decoders that treat the first token specially (leading spaces) consistent.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start: a character boundary
        self._read = 0  # ids before this have been emitted
        self._prefix_len = 0  # len(decode(ids[prefix:read]))

    def push(self, token_ids: list[int]) -> str:
        """The text the new ids add, or "" while the tail is an incomplete character."""
        self._ids.extend(token_ids)
        text = self.tokenizer.decode(self._ids[self._prefix:])
        # A trailing U+FFFD may be a character whose remaining bytes are in the next token. The
        # window only grows while that lasts: a few tokens for real text.
        if text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Everything held back, at the end of the stream (an incomplete tail is emitted as the
        decoder renders it)."""
        if self._read == len(self._ids):
            return ""
        return self._emit(self.tokenizer.decode(self._ids[self._prefix:]))

    def _emit(self, text: str) -> str:
        delta = text[self._prefix_len:]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_len = len(self.tokenizer.decode(self._ids[self._prefix:self._read]))
        return delta


def find_stop(text: str, stops: list[str], start: int) -> int | None:
    """Index of the earliest occurrence of a stop string in `text` that is new since `start`.

    `text[:start]` was searched before; the search begins at `start - longest + 1`, so a match
    spanning the previous delta boundary is found. Empty stop strings are ignored.
    """
    stops = [s for s in stops if s]
    if not stops:
        return None
    begin = max(0, start - max(map(len, stops)) + 1)
    hits = [i for i in (text.find(s, begin) for s in stops) if i >= 0]
    return min(hits, default=None)


def holdback(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` could be the beginning of a stop string.

    Streaming must hold these back: the next delta may complete the stop string, and text from
    a stop string on is never sent.
    """
    longest = 0
    for stop in stops:
        for k in range(min(len(stop), len(text)), longest, -1):
            if stop.startswith(text[-k:]):
                longest = k
                break
    return longest

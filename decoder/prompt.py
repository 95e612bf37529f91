"""DeepSeek-OCR's prompt format: BOS, then the text with each `<image>` tag replaced by a run of
image placeholder ids (one per image embedding), no role tags and no EOS."""
from __future__ import annotations

from .tokenizer import BOS_ID, IMAGE_TOKEN, IMAGE_TOKEN_ID

DEFAULT_PROMPT = "<image>\n<|grounding|>Convert the document to markdown."
PROMPTS = {
    "markdown": DEFAULT_PROMPT,
    "ocr": "<image>\nFree OCR.",
    "figure": "<image>\nParse the figure.",
    "describe": "<image>\nDescribe this image in detail.",
}


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


def image_positions(ids: list[int]) -> list[int]:
    """Positions of the image placeholders, where the image embeddings replace token embeddings."""
    return [i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID]

"""What each encoder replica serves (`ROLES`), so that the replica itself never asks: its paths,
what a request counts for in a batch, which views it makes of a decoded image, what it returns.

  GlobalPath  the GlobalEncoder: an image's global view -> its tokens;
  LocalPath   the LocalEncoder: a tiled image's crops -> their tokens;
  WholeImage  the Encoder of both paths (one_encoder, encoder_in_router): an image -> its whole
              sequence, assembled by the engine.
Each also checks what a caller sent before it joins a batch, where it would fail every request
of the batch.
"""
from __future__ import annotations

import torch

from encoder import DecodedImage, DualPathEncoder, PathTokens
from encoder.preprocess import MODES, Tiling, crops_of, global_view_of


def check_decoded(image: DecodedImage, tiling: Tiling) -> None:
    """A ValueError naming what is wrong with a decoded image a caller built (before it joins a
    batch, where it would fail every request of the batch), for an encoder of `tiling`."""
    if image.tiling != tiling:
        raise ValueError(f"an image measured for {image.tiling.name} sent to a {tiling.name} "
                         f"encoder")
    pixels = image.pixels
    if (not isinstance(pixels, torch.Tensor) or pixels.dtype != torch.uint8 or pixels.ndim != 3
            or pixels.shape[0] not in (1, 3) or min(pixels.shape) < 1):
        raise ValueError(f"decoded pixels must be uint8 [1 or 3, H, W], got "
                         f"{getattr(pixels, 'dtype', type(pixels).__name__)} {tuple(getattr(pixels, 'shape', ()))}")
    view_mode = tiling.check(image.mode, tiling.default_max_crops)
    grid, most = image.grid, tiling.max_crops_limit
    tiles = grid[0] * grid[1] if (isinstance(grid, tuple) and len(grid) == 2 and all(
        isinstance(n, int) and n >= 1 for n in grid)) else 0
    if not (grid == (1, 1) or (view_mode.crop and 2 <= tiles <= most)):
        raise ValueError(f"grid must be (width tiles, height tiles) of 2..{most} crops "
                         f"in a cropping mode, or (1, 1): not tiled; got {grid!r}")
    expected = tiling.count_tokens(grid, view_mode.base_size)
    if image.num_tokens != expected:
        raise ValueError(f"num_tokens {image.num_tokens!r} does not match grid {grid} in mode "
                         f"{image.mode!r} ({expected})")


def _check_views(views: torch.Tensor, shape: str, ok: bool) -> None:
    if not ok:
        raise ValueError(f"views must be uint8 {shape}, got "
                         f"{getattr(views, 'dtype', type(views).__name__)} {tuple(getattr(views, 'shape', ()))}")


class Role:
    """What a replica serves: its paths, what a request counts for in a batch, which views it
    makes of a decoded image, and what it returns per image. No replica method asks which role
    it has."""

    name: str  # "global", "local", "both": its `path` in stats and readiness
    label: str  # in errors
    paths: tuple[str, ...]  # the engine's

    def units(self, sent: DecodedImage | torch.Tensor) -> int:
        """What one request adds to a batch, in the unit of the engine's budgets."""
        return 1

    def check(self, sent: DecodedImage | torch.Tensor, tiling: Tiling) -> None:
        """Whether what was sent suits this role of an encoder of `tiling`: ValueError if not."""
        if isinstance(sent, DecodedImage):
            check_decoded(sent, tiling)
            self.check_decoded(sent)
        elif isinstance(sent, torch.Tensor):
            self.check_views(sent, tiling)
        else:
            raise ValueError(f"the {self.label} takes an ImageHeader, a DecodedImage or views, "
                             f"got {type(sent).__name__}")

    def check_decoded(self, image: DecodedImage) -> None:
        """Nothing more for most roles."""

    def check_views(self, views: torch.Tensor, tiling: Tiling) -> None:
        raise ValueError(f"the {self.label} makes its own views: send it the image "
                         f"(an ImageHeader or a DecodedImage), not a tensor")

    def views_of(self, image: DecodedImage, pixels: torch.Tensor) -> tuple:
        """(global view, crops) of an image's pixels, already on this replica's device."""
        raise NotImplementedError

    def as_sent(self, views: torch.Tensor) -> tuple:
        """(global view, crops) of views the router made."""
        raise NotImplementedError

    def results(self, engine: DualPathEncoder, outputs: list[PathTokens],
                sent: list[DecodedImage | torch.Tensor]) -> list[torch.Tensor]:
        """Per image of a batch (`sent`: each as sent), what this role returns."""
        raise NotImplementedError

    def stats(self, engine_stats: dict) -> dict:
        return engine_stats[self.name]


class GlobalPath(Role):
    """The GlobalEncoder: an image's global view -> its tokens ([g*(g+1), D]; DeepSeek-OCR 2: [256, D])."""

    name, label, paths = "global", "GlobalEncoder", ("global",)

    def check_views(self, views: torch.Tensor, tiling: Tiling) -> None:
        sizes = sorted({MODES[mode].base_size for mode in tiling.modes})
        _check_views(views, f"[3, S, S] with S one of {sizes}",
                     views.dtype == torch.uint8 and views.ndim == 3 and views.shape[0] == 3
                     and views.shape[1] == views.shape[2] and views.shape[1] in sizes)

    def views_of(self, image: DecodedImage, pixels: torch.Tensor) -> tuple:
        return global_view_of(pixels, image.mode), None

    def as_sent(self, views: torch.Tensor) -> tuple:
        return views, None

    def results(self, engine, outputs, sent):
        return [o.global_tokens for o in outputs]


class LocalPath(Role):
    """The LocalEncoder: a tiled image's crops -> their tokens ([P, 100, D]; DeepSeek-OCR 2: [P, 144, D])."""

    name, label, paths = "local", "LocalEncoder", ("local",)

    def units(self, sent: DecodedImage | torch.Tensor) -> int:
        return sent.grid[0] * sent.grid[1] if isinstance(sent, DecodedImage) else len(sent)

    def check_decoded(self, image: DecodedImage) -> None:
        if not image.tiled:
            raise ValueError("the LocalEncoder encodes crops: this image is not tiled (grid (1, 1))")

    def check_views(self, views: torch.Tensor, tiling: Tiling) -> None:
        side, most = tiling.crop_size, tiling.max_crops_limit
        _check_views(views, f"[P, 3, {side}, {side}] with P in 1..{most}",
                     views.dtype == torch.uint8 and views.ndim == 4
                     and tuple(views.shape[1:]) == (3, side, side) and 1 <= views.shape[0] <= most)

    def views_of(self, image: DecodedImage, pixels: torch.Tensor) -> tuple:
        return None, crops_of(pixels, image.grid, side=image.tiling.crop_size)

    def as_sent(self, views: torch.Tensor) -> tuple:
        return None, views

    def results(self, engine, outputs, sent):
        return [o.crop_tokens for o in outputs]


class WholeImage(Role):
    """The Encoder (one_encoder; with encoder_in_router, in the Router's process): an image ->
    its whole sequence [num_tokens, D], assembled by the engine as in-process callers get it."""

    name, label, paths = "both", "Encoder of both paths", ("global", "local")

    def views_of(self, image: DecodedImage, pixels: torch.Tensor) -> tuple:
        crops = crops_of(pixels, image.grid, side=image.tiling.crop_size) if image.tiled else None
        return global_view_of(pixels, image.mode), crops

    def results(self, engine, outputs, sent):
        return engine.sequences(outputs, [image.grid for image in sent])

    def stats(self, engine_stats: dict) -> dict:
        return engine_stats


ROLES: dict[str, Role] = {role.name: role for role in (GlobalPath(), LocalPath(), WholeImage())}

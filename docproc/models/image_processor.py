"""Qwen2-VL's image preprocessing, read from a checkpoint's preprocessor_config.json: resize to a
patch-aligned size within the pixel budget, rescale and normalise, cut into patches in the vision
tower's order. The same numbers as transformers' Qwen2VLImageProcessorPil (a test holds it to
that, value for value); our own so that the engine's start does not import transformers' image
processing stack (which imports its modeling code, seconds of every start).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) an image is resized to: each side a multiple of `factor` (patch x merge),
    the area within [min_pixels, max_pixels], the aspect ratio kept as closely as those allow.
    ValueError for an aspect ratio over 200 (the model's limit)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:  # shrink both sides by the same factor, rounding down
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:  # grow, rounding up
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


class ImageProcessor:
    """preprocessor_config.json's fields (transformers' names and defaults):
    size {shortest_edge, longest_edge} or min_pixels / max_pixels, patch_size, temporal_patch_size,
    merge_size, resample, do_resize, do_rescale, rescale_factor, do_normalize, image_mean, image_std."""

    def __init__(self, config: dict) -> None:
        size = config.get("size") if isinstance(config.get("size"), dict) else {}
        self.min_pixels = int(config.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 56 * 56)
        self.max_pixels = int(config.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
                              or 28 * 28 * 1280)
        self.patch_size = int(config.get("patch_size", 14))
        self.temporal_patch_size = int(config.get("temporal_patch_size", 2))
        self.merge_size = int(config.get("merge_size", 2))
        self.resample = Image.Resampling(int(config.get("resample", Image.Resampling.BICUBIC)))
        self.do_resize = bool(config.get("do_resize", True))
        self.do_rescale = bool(config.get("do_rescale", True))
        self.rescale_factor = float(config.get("rescale_factor", 1 / 255))
        self.do_normalize = bool(config.get("do_normalize", True))
        self.mean = np.array(config.get("image_mean", CLIP_MEAN), dtype=np.float32)
        self.std = np.array(config.get("image_std", CLIP_STD), dtype=np.float32)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ImageProcessor":
        return cls(json.loads((Path(folder) / "preprocessor_config.json").read_text()))

    @property
    def signature(self) -> tuple:
        """What decides an image's patches and tokens (a draft must match its target on this)."""
        return (self.min_pixels, self.max_pixels, self.patch_size, self.temporal_patch_size, self.merge_size)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        if not self.do_resize:
            factor = self.patch_size * self.merge_size
            if height % factor or width % factor:
                raise ValueError(f"the checkpoint's preprocessor does not resize (do_resize false), and "
                                 f"{width}x{height} is not a multiple of {factor} pixels a side")
            return height, width
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def patches(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """An RGB image's (num_patches, C * T * P * P) float32 patches and its (1, rows, cols) grid."""
        h, w = self.resized_size(image.height, image.width)
        if (w, h) != image.size:
            image = image.resize((w, h), resample=self.resample)
        x = np.asarray(image, dtype=np.uint8)  # (H, W, C)
        if self.do_rescale:  # in float64, then float32, as transformers rescales
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            x = x.astype(np.float32)
        if self.do_normalize:
            x = (x - self.mean) / self.std
        c = x.shape[-1]
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        # (H, W, C) -> merge windows row by row, their patches row by row, each patch C x T x P x P
        x = x.reshape(gh // m, m, p, gw // m, m, p, c).transpose(0, 3, 1, 4, 6, 2, 5)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))  # an image is T equal frames
        return x.reshape(gh * gw, c * t * p * p), (1, gh, gw)

"""Prompts and images in, token ids and image spans out.

vLLM's convention: the prompt holds one `<|image_pad|>` per image (inside
`<|vision_start|>...<|vision_end|>`); the engine expands each to the image's token count. Images
may be PIL images, paths or bytes; each is keyed by the SHA-256 of its decoded RGB pixels and size,
so the same page given as a file, as bytes or as a PIL image hits the same caches. Every image is
converted as a person sees it (docproc.multimodal.to_rgb) and padded with white into the vision
tower's aspect-ratio limit, so no page shape is refused.
"""
from __future__ import annotations

import functools
import io
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from docproc.models.image_processor import ImageProcessor
from docproc.models.loader import CheckpointError
from docproc.models.tokenizer_files import GENERIC_TOKENIZERS, missing_tokenizer, tokenizer_class
from docproc.multimodal import IMAGE_PAD, ImageSpan, PromptError, fit_aspect, padded_size, pixel_hash, to_rgb


@dataclass
class LoadedImage:
    image: Image.Image  # RGB, padded into the aspect-ratio limit
    content_hash: str  # of the RGB pixels before padding (what the pipeline hashes a page by)


def load_image(obj, content_hash: str | None = None) -> LoadedImage:
    """Decode an image; content_hash, when the caller already has one (a page's SHA-256), replaces
    hashing the pixels."""
    try:
        if isinstance(obj, LoadedImage):
            return obj
        if isinstance(obj, Image.Image):
            img = obj
        elif isinstance(obj, (bytes, bytearray, memoryview)):
            img = Image.open(io.BytesIO(bytes(obj)))
        elif isinstance(obj, (str, Path)):
            img = Image.open(obj)
        else:
            raise PromptError(f"unsupported image type {type(obj).__name__}: pass a PIL image, a path or bytes")
        img.load()
    except Image.UnidentifiedImageError:
        what = f" {obj}" if isinstance(obj, (str, Path)) else f" ({len(obj)} bytes)" if isinstance(
            obj, (bytes, bytearray, memoryview)) else ""
        raise PromptError(f"cannot read image{what}: not an image format Pillow recognises") from None
    except (OSError, Image.DecompressionBombError) as e:
        raise PromptError(f"cannot read image: {e}") from None
    except (ValueError, TypeError, SyntaxError, KeyError, IndexError, struct.error, EOFError) as e:
        # a damaged file Pillow's plugins fail on in their own ways (a truncated QOI or DDS, an IM
        # header naming no mode, a TIFF tag of the wrong type)
        raise PromptError(f"cannot read image: {type(e).__name__}: {e}") from None
    try:
        img = to_rgb(img)
    except (OSError, ValueError, TypeError, SyntaxError, KeyError, IndexError, struct.error, EOFError) as e:
        raise PromptError(f"cannot read image: {e}") from None  # pixel data that fails to decode only now
    digest = str(content_hash) if content_hash is not None else pixel_hash(img)
    return LoadedImage(fit_aspect(img), digest)


def load_tokenizer(folder: str | Path):
    """The checkpoint's tokenizer. One whose tokenizer_config names the generic tokenizers backend
    (the bundled pair's) is loaded as that class directly: transformers' AutoTokenizer imports its
    auto-model machinery, seconds of an engine's start with some transformers releases (6 s on the
    H200 machine's 5.17). Any other class goes through AutoTokenizer. A folder without the files
    is named in one line (transformers' own error is about installing sentencepiece)."""
    folder = Path(folder)
    missing = missing_tokenizer(folder)
    if missing is not None:
        raise CheckpointError(f"{folder} {missing}")
    try:
        if tokenizer_class(folder) in GENERIC_TOKENIZERS and (folder / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder}: cannot load the tokenizer: {e}") from None


class Processor:
    def __init__(self, folder: str | Path, hf_config) -> None:
        folder = Path(folder)
        if not (folder / "preprocessor_config.json").is_file():
            raise CheckpointError(f"{folder}: preprocessor_config.json is missing (image min/max pixels, patch size)")
        self.tokenizer = load_tokenizer(folder)
        try:
            self.image_processor = ImageProcessor.from_folder(folder)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{folder}: cannot read preprocessor_config.json: {e}") from None
        self.image_token_id = hf_config.image_token_id
        self.merge_size = hf_config.vision_config.spatial_merge_size
        ip = self.image_processor
        if ip.patch_size != hf_config.vision_config.patch_size or ip.merge_size != self.merge_size:
            raise CheckpointError(
                f"{folder}: preprocessor patch/merge size ({ip.patch_size}/{ip.merge_size}) differ from the "
                f"vision config ({hf_config.vision_config.patch_size}/{self.merge_size})"
            )

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes one token's text can hold (at least 1): a text of n characters is at
        least n / this many tokens."""
        return max([1, *(len(t.encode()) for t in self.tokenizer.get_vocab())])

    def grid_thw(self, image: Image.Image) -> tuple[int, int, int]:
        ip = self.image_processor
        w, h = padded_size(*image.size)  # what load_image hands the vision tower
        try:
            rh, rw = ip.resized_size(h, w)
        except ValueError as e:
            raise PromptError(f"image of {w}x{h} pixels: {e}") from None
        return (1, rh // ip.patch_size, rw // ip.patch_size)

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        """Prompt tokens of an image with this patch grid (patches merged merge_size x merge_size)."""
        return grid[0] * grid[1] * grid[2] // self.merge_size ** 2

    def pixel_values(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_patches, C*T*P*P) float32 patches of all images, and their (num_images, 3) grids."""
        patches, grids = zip(*(self.image_processor.patches(im) for im in images))
        return torch.from_numpy(np.concatenate(patches)), torch.tensor(grids, dtype=torch.int64)

    def process(self, prompt: str | None, prompt_token_ids: list[int] | None, images: list,
                uuids: list[str] | None = None, memo: dict | None = None,
                ) -> tuple[list[int], list[ImageSpan], list[LoadedImage]]:
        """memo: loaded images by (id of the caller's PIL image, uuid), shared by the requests of one
        generate() call (the queries of a page pass the same object): each is converted and hashed
        once, not once per request. Only valid while those objects are alive and unchanged."""
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise PromptError(f"prompt must be a string, got {type(prompt).__name__}")
            prompt_token_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = list(prompt_token_ids)
        pads = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(pads) != len(images):
            raise PromptError(
                f"the prompt has {len(pads)} {IMAGE_PAD} placeholder(s) but {len(images)} image(s) were given: "
                f"put one {IMAGE_PAD} per image"
            )
        if uuids is not None and len(uuids) != len(images):
            raise PromptError(f"{len(uuids)} multi_modal_uuids for {len(images)} images: give one per image")
        loaded = []
        for i, im in enumerate(images):
            uid = None if uuids is None else uuids[i]
            key = (id(im), uid) if memo is not None and isinstance(im, Image.Image) else None
            if key is not None and key in memo:
                loaded.append(memo[key])
                continue
            li = load_image(im, uid)
            if key is not None:
                memo[key] = li
            loaded.append(li)
        out: list[int] = []
        spans: list[ImageSpan] = []
        prev = 0
        for pad, im in zip(pads, loaded):
            out.extend(ids[prev:pad])
            grid = self.grid_thw(im.image)
            n = self.num_tokens(grid)
            spans.append(ImageSpan(len(out), n, im.content_hash, grid, self.merge_size))
            out.extend([self.image_token_id] * n)
            prev = pad + 1
        out.extend(ids[prev:])
        return out, spans, loaded

"""Torch-free pieces that the pipeline, the engine and the models share: the image placeholder of
a prompt, an image's span of tokens in a sequence, how a file's pixels become the RGB page a
person sees, the pixel hash that keys the caches, and the padding that brings any page within
the vision tower's aspect-ratio limit."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from PIL import Image, ImageOps

IMAGE_PAD = "<|image_pad|>"  # one per image in a prompt; the engine expands it by the image's grid
IMAGE_PLACEHOLDER = f"<|vision_start|>{IMAGE_PAD}<|vision_end|>"  # an image in Qwen2-VL's chat format



class PromptError(ValueError):
    """A request that cannot be run as given; it fails alone."""


@dataclass(frozen=True)
class ImageSpan:
    """One image's run of pad tokens inside a sequence."""

    offset: int  # index of the first image-pad token in token_ids
    num_tokens: int  # = t * (h / merge) * (w / merge)
    content_hash: str  # hex SHA-256 of the decoded pixels (and size); keys prefix and encoder caches
    grid_thw: tuple[int, int, int]  # patch grid before merging
    merge_size: int

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    @property
    def position_span(self) -> int:
        """How far M-RoPE's text position advances over this image (transformers' get_rope_index)."""
        _, h, w = self.grid_thw
        return max(h, w) // self.merge_size



# Qwen2-VL's image processor refuses pages whose long side is more than 200 times the short one
MAX_ASPECT_RATIO = 200
PAD_COLOUR = (255, 255, 255)  # paper
# a padded page's most pixels: a 1 x 200,000 strip padded whole would be 200 Mpx (the vision
# tower resizes every page to at most ~12.8 Mpx anyway), so a page that would pad past this is
# scaled down first
MAX_PADDED_PIXELS = 4096 * 4096
EXIF_ORIENTATION = 0x0112
TURNED = range(2, 9)  # orientations other than "as stored" (1)


def to_rgb(img: Image.Image) -> Image.Image:
    """The image as a person sees it, in RGB: EXIF orientation applied; transparency (RGBA, LA,
    palette or greyscale with a transparent colour) composited on white; 16- and 32-bit greyscale
    scaled to 8 bits by its bit depth (not clipped); CMYK, YCbCr, LAB, HSV and 1-bit converted."""
    try:
        # (exif_transpose copies an image it does not turn: a rendered page has nothing to turn)
        if img.getexif().get(EXIF_ORIENTATION, 1) in TURNED:
            img = ImageOps.exif_transpose(img) or img
    except (ValueError, TypeError, SyntaxError, OSError, KeyError):  # a malformed EXIF block: keep as stored
        pass
    mode = img.mode
    if mode == "RGB" and "transparency" not in img.info:
        return img
    if mode.startswith("I;16") or mode in ("I", "F"):
        img = _deep_grey_to_l(img)
        mode = "L"
    if mode == "P" or (mode in ("L", "RGB") and "transparency" in img.info):
        img = img.convert("RGBA")
    elif mode in ("LA", "La", "PA", "RGBa"):
        img = img.convert("RGBA")
    if img.mode == "RGBA":
        page = Image.new("RGB", img.size, PAD_COLOUR)
        page.paste(img, mask=img.getchannel("A"))
        return page
    return img.convert("RGB")


def _deep_grey_to_l(img: Image.Image) -> Image.Image:
    """16-bit (I;16*), 32-bit integer (I) and float (F) greyscale to 8 bits. A PNG or TIFF of 16
    bits spans 0..65535; a 32-bit integer image is taken as 16-bit data when its values fit 16
    bits (that is how Pillow opens most 16-bit files) and as 8-bit data when they fit 8 bits, else
    scaled by its own maximum; a float image of values in 0..1 is scaled by 255."""
    import numpy as np

    a = np.asarray(img)
    if a.dtype.kind == "f":
        a = np.nan_to_num(a.astype(np.float64))
        top = 1.0 if a.max(initial=0.0) <= 1.0 else 255.0 if a.max(initial=0.0) <= 255.0 else float(a.max())
        out = np.clip(a / top * 255.0 + 0.5, 0, 255)
    else:
        a = a.astype(np.int64)
        hi = int(a.max(initial=0))
        top = 65535 if img.mode.startswith("I;16") else 255 if hi <= 255 else 65535 if hi <= 65535 else hi
        out = np.clip(a, 0, None) * 255 // max(top, 1)
    return Image.fromarray(out.astype(np.uint8), "L")


def pixel_hash(img: Image.Image) -> str:
    """SHA-256 of an RGB image's size and pixels: the content key of a rendered page."""
    h = hashlib.sha256(b"%dx%d:" % img.size)
    h.update(img.tobytes())
    return h.hexdigest()


def _fit(width: int, height: int, max_ratio: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(the image's size after any downscale, the padded page's size)."""
    width, height = max(1, width), max(1, height)
    long, short = max(width, height), min(width, height)
    if long <= short * max_ratio:
        return (width, height), (width, height)
    padded_short = -(-long // max_ratio)
    if long * padded_short > MAX_PADDED_PIXELS:
        # the longest side L with L * (L / max_ratio + 1) <= MAX_PADDED_PIXELS
        new_long = int((-max_ratio + (max_ratio ** 2 + 4 * max_ratio * MAX_PADDED_PIXELS) ** 0.5) / 2)
        long, short = new_long, max(1, round(short * new_long / long))
        padded_short = -(-long // max_ratio)
    image = (long, short) if width >= height else (short, long)
    page = (long, padded_short) if width >= height else (padded_short, long)
    return image, page


def padded_size(width: int, height: int, max_ratio: int = MAX_ASPECT_RATIO) -> tuple[int, int]:
    """The size of the page fit_aspect makes of an image of this size."""
    return _fit(width, height, max_ratio)[1]


def fit_aspect(img: Image.Image, max_ratio: int = MAX_ASPECT_RATIO) -> Image.Image:
    """An RGB page whose long side is at most max_ratio times its short side: padded with white
    below or to the right (the image itself when no padding is needed), first scaled down when
    the padded page would exceed MAX_PADDED_PIXELS. Padding rather than squeezing keeps the
    text's shape: a 2000 x 8 strip stays a strip of readable height on a white band, where a
    resize would flatten it."""
    image, page = _fit(*img.size, max_ratio)
    if page == img.size:
        return img
    if image != img.size:
        img = img.resize(image, Image.Resampling.BOX)
    out = Image.new("RGB", page, PAD_COLOUR)
    out.paste(img, (0, 0))
    return out


def safe_text(text: str) -> str:
    """Text that UTF-8 can store: surrogate escapes (bytes of a file name that are not UTF-8,
    carried into a message) become backslash escapes."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")

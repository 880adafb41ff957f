"""Torch-free image pieces that the pipeline and the engine share: how a file's pixels become the
RGB page a person sees, the pixel hash that keys the caches, and the padding that brings any page
within the vision tower's aspect-ratio limit."""
from __future__ import annotations

import hashlib

from PIL import Image, ImageOps

# Qwen2-VL's image processor refuses pages whose long side is more than 200 times the short one
MAX_ASPECT_RATIO = 200
PAD_COLOUR = (255, 255, 255)  # paper


def to_rgb(img: Image.Image) -> Image.Image:
    """The image as a person sees it, in RGB: EXIF orientation applied; transparency (RGBA, LA,
    palette or greyscale with a transparent colour) composited on white; 16- and 32-bit greyscale
    scaled to 8 bits by its bit depth (not clipped); CMYK, YCbCr, LAB, HSV and 1-bit converted."""
    try:
        img = ImageOps.exif_transpose(img) or img
    except (ValueError, TypeError, SyntaxError, OSError, KeyError):  # a malformed EXIF block: keep as stored
        pass
    mode = img.mode
    if mode == "RGB":
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


def padded_size(width: int, height: int, max_ratio: int = MAX_ASPECT_RATIO) -> tuple[int, int]:
    """The size a page is padded to (with white, below or to the right) so that its long side is at
    most max_ratio times its short side; the size itself when it already is."""
    width, height = max(1, width), max(1, height)
    if width > height * max_ratio:
        height = -(-width // max_ratio)
    elif height > width * max_ratio:
        width = -(-height // max_ratio)
    return width, height


def fit_aspect(img: Image.Image, max_ratio: int = MAX_ASPECT_RATIO) -> Image.Image:
    """An RGB page padded with white to padded_size (the image itself when no padding is needed).
    Padding rather than squeezing keeps the text's shape: a 2000 x 8 strip stays a strip of
    readable height on a white band, where a resize would flatten it."""
    size = padded_size(*img.size, max_ratio=max_ratio)
    if size == img.size:
        return img
    page = Image.new("RGB", size, PAD_COLOUR)
    page.paste(img, (0, 0))
    return page

"""Finding documents and turning them into page images, one document at a time.

Discovery is recursive and lazy (a generator over the tree), so memory does not grow with the
number of files; a document's pages are rendered when its batch runs. Every file ends as exactly
one outcome: a document, or a skip/error with a reason. Untrusted input is capped: pages per
document, pixels per page (PDFs render at a DPI lowered to fit the cap; images above it, and
decompression bombs, are errors), and symlinks that leave the input root are skipped.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from PIL import Image

PDF_SUFFIXES = {".pdf"}
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".tif", ".tiff", ".webp", ".bmp"}
DEFAULT_MAX_PIXELS = 40_000_000  # per page; a 300-dpi A3 page is 17.5 M


class DocumentError(Exception):
    """This file cannot be processed; the message is the reason recorded in its outcome row."""


@dataclass
class Candidate:
    path: Path
    rel: str  # path relative to its input root (or the file name for a file input)
    skip_reason: str | None = None

    @property
    def kind(self) -> str:
        return "pdf" if self.path.suffix.lower() in PDF_SUFFIXES else "image"


@dataclass
class Page:
    index: int  # 0-based page (or frame) number
    image: Image.Image  # RGB
    sha256: str  # file bytes for single-image files; rendered pixels + size for PDF pages and frames
    width: int
    height: int
    text: str | None = None  # the PDF's text layer with coordinates (--anchor-text); None for images


ANCHOR_MAX_CHARS = 4000  # per page: a page with more text keeps its first lines and says it was cut


def text_lines(page) -> list[tuple[float, float, float, float, str]]:
    """A PDF page's text layer as lines (x0, y0, x1, y1, text) in points, blank lines dropped."""
    out = []
    for block in page.get_text("dict", sort=True)["blocks"]:
        for ln in block.get("lines", []):
            text = "".join(span["text"] for span in ln["spans"]).strip()
            if text:
                out.append((*ln["bbox"], text))
    return out


def anchor_text(page) -> str:
    """A PDF page's own text layer as prompt anchoring (as olmOCR does it): the page size in
    points, then one line per text line, top to bottom and left to right, as `[x,y]text` with the
    line's top-left corner in points. Empty when the page has no text layer."""
    lines = [(round(y0), round(x0), text) for x0, y0, _, _, text in text_lines(page)]
    if not lines:
        return ""
    lines.sort()
    out = [f"Page size: {round(page.rect.width)}x{round(page.rect.height)}"]
    size = len(out[0])
    for y, x, text in lines:
        item = f"[{x},{y}]{text}"
        if size + len(item) + 1 > ANCHOR_MAX_CHARS:
            out.append("[...]")
            break
        out.append(item)
        size += len(item) + 1
    return "\n".join(out)


class Document:
    """An opened document: its file hash and page count are known; pages render on demand, so a
    1,000-page PDF never holds more than the pages of the window being processed."""

    def __init__(self, candidate: Candidate, sha256: str, num_pages_total: int, max_pages: int | None,
                 render, closer=None) -> None:
        self.candidate = candidate
        self.sha256 = sha256
        self.num_pages_total = num_pages_total
        self.num_pages = num_pages_total if max_pages is None else min(max_pages, num_pages_total)
        self.truncated = self.num_pages < num_pages_total
        self._render = render  # index -> Page
        self._closer = closer

    def page(self, index: int) -> Page:
        if not 0 <= index < self.num_pages:
            raise IndexError(index)
        return self._render(index)

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
            self._closer = None


def discover(inputs: list[str | Path]) -> Iterator[Candidate]:
    """Yield every file under the inputs, sorted within each folder for stable runs."""
    for inp in inputs:
        root = Path(inp)
        if root.is_file():
            yield _classify(root, root.name, root.parent)
            continue
        if not root.is_dir():
            yield Candidate(root, str(inp), "input path does not exist")
            continue
        real_root = root.resolve()
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames.sort()
            for name in sorted(filenames) + sorted(d for d in dirnames if (Path(dirpath) / d).is_symlink()):
                p = Path(dirpath) / name
                rel = str(p.relative_to(root))
                if p.is_symlink():
                    target = p.resolve()
                    if not target.is_relative_to(real_root):
                        yield Candidate(p, rel, "symlink points outside the input folder")
                        continue
                    if target.is_dir():
                        continue  # its files are reached through their real location
                yield _classify(p, rel, real_root)


def _classify(p: Path, rel: str, root: Path) -> Candidate:
    suffix = p.suffix.lower()
    if suffix not in PDF_SUFFIXES | IMAGE_SUFFIXES:
        return Candidate(p, rel, f"not a supported document type ({suffix or 'no extension'})")
    return Candidate(p, rel)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pixel_hash(img: Image.Image) -> str:
    h = hashlib.sha256(b"%dx%d:" % img.size)
    h.update(img.tobytes())
    return h.hexdigest()


def open_document(c: Candidate, *, dpi: int = 120, max_pages: int | None = None,
                  max_pixels: int = DEFAULT_MAX_PIXELS, max_file_bytes: int = 1 << 30,
                  with_text: bool = False) -> Document:
    """Open, validate and hash a document; page 1 is rendered here so that a file whose pages
    cannot be read fails at once with its reason."""
    try:
        size = c.path.stat().st_size
    except OSError as e:
        raise DocumentError(f"cannot read file: {e.strerror}") from None
    if size == 0:
        raise DocumentError("empty file (0 bytes)")
    if size > max_file_bytes:
        raise DocumentError(f"file is {size} bytes, over the {max_file_bytes}-byte limit")
    try:
        digest = _sha256_file(c.path)
    except OSError as e:
        raise DocumentError(f"cannot read file: {e.strerror}") from None
    doc = _open_pdf(c, digest, dpi, max_pages, max_pixels, with_text) if c.kind == "pdf" else \
        _open_image(c, digest, max_pages, max_pixels)
    try:
        doc.page(0)
    except Exception:
        doc.close()
        raise
    return doc


def _open_pdf(c: Candidate, digest: str, dpi: int, max_pages: int | None, max_pixels: int,
              with_text: bool = False) -> Document:
    import pymupdf

    try:
        pdf = pymupdf.open(str(c.path), filetype="pdf")
    except Exception as e:  # pymupdf raises its own FileDataError / RuntimeError variants
        raise DocumentError(f"not a readable PDF: {e}") from None
    if pdf.needs_pass:
        pdf.close()
        raise DocumentError("PDF is encrypted and needs a password")
    if pdf.page_count == 0:
        pdf.close()
        raise DocumentError("PDF has zero pages")

    def render(i: int) -> Page:
        try:
            page = pdf.load_page(i)
            w_in, h_in = page.rect.width / 72.0, page.rect.height / 72.0
            page_dpi = dpi
            if w_in * h_in * dpi * dpi > max_pixels:  # lower the DPI to fit the pixel cap
                page_dpi = max(1, int((max_pixels / max(w_in * h_in, 1e-6)) ** 0.5))
            pix = page.get_pixmap(dpi=page_dpi, alpha=False, colorspace=pymupdf.csRGB)
            text = anchor_text(page) if with_text else None
        except Exception as e:
            raise DocumentError(f"cannot render page {i + 1}: {e}") from None
        img = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
        return Page(i, img, _pixel_hash(img), img.width, img.height, text or None)

    return Document(c, digest, pdf.page_count, max_pages, render, pdf.close)


def _open_image(c: Candidate, digest: str, max_pages: int | None, max_pixels: int) -> Document:
    try:
        im = Image.open(c.path)
        frames = getattr(im, "n_frames", 1)
    except Image.DecompressionBombError as e:
        raise DocumentError(f"image rejected as a decompression bomb: {e}") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise DocumentError(f"not a readable image: {e}") from None

    def render(i: int) -> Page:
        try:
            im.seek(i)
            if im.width * im.height > max_pixels:
                raise DocumentError(
                    f"image {'frame %d ' % (i + 1) if frames > 1 else ''}is {im.width}x{im.height} pixels, "
                    f"over the {max_pixels}-pixel cap")
            rgb = im.convert("RGB")
            rgb.load()
        except DocumentError:
            raise
        except Image.DecompressionBombError as e:
            raise DocumentError(f"image rejected as a decompression bomb: {e}") from None
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise DocumentError(f"not a readable image: {e}") from None
        # a single image is keyed by its file bytes; frames of a multi-page file by their pixels
        return Page(i, rgb, digest if frames == 1 else _pixel_hash(rgb), rgb.width, rgb.height)

    return Document(c, digest, frames, max_pages, render, im.close)

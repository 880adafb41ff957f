"""Finding documents and turning them into page images, one document at a time.

Every file under the inputs ends as exactly one outcome: a document, or a skip or error with a
reason and a kind. A document's key is unique and stable: its path relative to its input root,
behind the root as given when several roots are given; names that are not UTF-8 keep their bytes
as backslash escapes (`r\\xe4.jpg`); a file reached twice (the same input twice, a folder and its
subfolder, a link to a file in the tree, a hard link) counts once, under its first real path.
Folders excluded by the caller (the output folder) are never entered. Untrusted input is capped:
pages per document, pixels per page (PDFs render at a DPI lowered to fit the cap; images above
it, and decompression bombs, are errors); links that leave the input root, broken links and
special files (FIFOs, sockets, devices) are skipped. A document's pages are rendered when its
batch runs.
"""
from __future__ import annotations

import errno
import functools
import hashlib
import os
import re
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from docproc.multimodal import pixel_hash, to_rgb

PDF_SUFFIXES = {".pdf"}
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".tif", ".tiff", ".webp", ".bmp"}
DEFAULT_MAX_PIXELS = 40_000_000  # per page; a 300-dpi A3 page is 17.5 M


class DocumentError(Exception):
    """This file cannot be processed; the message is the reason recorded in its outcome row and
    kind its class (docs/outputs.md lists them)."""

    def __init__(self, message: str, kind: str = "unreadable") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Candidate:
    path: Path  # the file as found (a name that is not UTF-8 holds surrogate escapes)
    rel: str  # the document's key: relative to its input root (see the module docstring)
    root: str = ""  # the real, absolute path of the input root it was found under
    skip_reason: str | None = None
    kind: str | None = None  # the skip's or error's kind
    is_error: bool = False  # an error outcome (an unlistable folder), not a skip

    @functools.cached_property
    def doc_type(self) -> str:
        """pdf or image: by the name's suffix, but a file named as an image that starts with a PDF's
        %PDF- header is one (an image whose metadata holds the text further on stays an image)."""
        if self.path.suffix.lower() in PDF_SUFFIXES:
            return "pdf"
        try:
            with open(self.path, "rb") as f:
                return "pdf" if f.read(5) == b"%PDF-" else "image"
        except OSError:
            return "image"  # (opening it says why)


@dataclass
class Page:
    index: int  # 0-based page (or frame) number
    image: Image.Image  # RGB
    sha256: str  # file bytes for single-image files; rendered pixels + size for PDF pages and frames
    width: int
    height: int
    text: str | None = None  # the PDF's text layer with coordinates (--anchor-text); None for images

    @functools.cached_property
    def blank(self) -> bool:
        """Nothing on the page: no text layer, and fewer than 1 pixel in 10,000 (about 130 on a
        letter page at 120 dpi) differs by more than 32 grey levels from the page's median (a
        faint grey print still counts). Such a page holds no field to read, and a model asked
        about it invents one."""
        if self.text:
            return False
        try:
            hist = self.image.convert("L").histogram()
        except Exception:  # noqa: BLE001 -- (an image PIL cannot grey: read by the engine, which says why)
            return False
        total = sum(hist)
        median, seen = 0, 0
        while seen + hist[median] < total / 2:
            seen += hist[median]
            median += 1
        ink = sum(hist[:max(0, median - 32)]) + sum(hist[median + 33:])
        return ink * 10_000 < total


def display_name(name: str) -> str:
    """A file system name as text that UTF-8 can store, one text per name: bytes that are not
    UTF-8 (held by Python as surrogate escapes) become `\\xNN`, and a backslash becomes `\\\\`
    (so the byte 0xE4 and a file literally named `\\xe4` stay two keys). A name with neither is
    kept as it is."""
    if "\\" not in name and not any("\udc80" <= ch <= "\udcff" for ch in name):
        return name
    return "".join("\\\\" if ch == "\\" else f"\\x{ord(ch) - 0xDC00:02x}" if "\udc80" <= ch <= "\udcff" else ch
                   for ch in name)


def root_label(inp: str | Path) -> str:
    """How a root is named in its documents' keys when several roots are given: the path as
    given, normalised (`./in/` -> `in`)."""
    return display_name(os.path.normpath(str(inp)))


def _is_within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def discover(inputs: list[str | Path], exclude: list[str | Path] = ()) -> list[Candidate]:
    """Every file under the inputs, in a stable order (sorted within each folder; within a root,
    real files before links so that a file and a link to it keep the file's key), each file once.
    exclude: folders never entered, nor reached through a link (the output folder)."""
    excluded = [os.path.realpath(e) for e in exclude]
    seen: set[tuple] = set()
    unique, real_inputs = [], set()
    for inp in inputs:  # the same root given twice is one root
        real = os.path.realpath(inp)
        if real not in real_inputs:
            real_inputs.add(real)
            unique.append(inp)
    several = len(unique) > 1
    out: list[Candidate] = []
    for inp in unique:
        root = Path(inp)
        label = root_label(inp) if several else ""
        real_root = os.path.realpath(root)
        shown_root = display_name(real_root)  # what rows record as the root

        def key(rel: str) -> str:
            rel = display_name(rel)
            return f"{label}/{rel}" if label else rel

        def folder_key(path: str | None) -> str:
            """An unlistable folder's key: its path and a slash ('./' alone for the root)."""
            rel = os.path.relpath(path, root) if path else "."
            if rel == ".":
                return f"{label}/" if label else "./"
            return key(rel) + "/"

        if not root.is_dir():
            name = label or display_name(root.name)
            if not os.path.lexists(root):
                out.append(Candidate(root, name, shown_root, "input path does not exist", "missing"))
                continue
            out.extend(_candidate(root, name, shown_root, excluded, seen))  # the file is its own root
            continue
        links: list[tuple[Path, str]] = []
        failed: list[OSError] = []
        for dirpath, dirnames, filenames in os.walk(root, onerror=failed.append, followlinks=False):
            for e in failed:  # folders that could not be listed: their files would go unseen
                out.append(Candidate(Path(e.filename or root), folder_key(e.filename), shown_root,
                                     f"cannot list folder: {e.strerror}", "unlistable_folder", is_error=True))
            failed.clear()
            dirnames.sort()
            filenames.sort()
            probe = next(iter(dirnames + filenames), None)
            if probe is not None and _unsearchable(Path(dirpath) / probe):
                # listed but not searchable (mode r--): no entry can be looked at; the folder is
                # one error row, as an unlistable one, and OUT keeps what it holds from it
                out.append(Candidate(Path(dirpath), folder_key(dirpath), shown_root,
                                     f"cannot list folder: {os.strerror(errno.EACCES)} (it can be listed but not "
                                     f"searched)", "unlistable_folder", is_error=True))
                dirnames[:] = []
                continue
            keep = []
            for d in dirnames:
                p = Path(dirpath) / d
                try:
                    is_link = stat.S_ISLNK(os.lstat(p).st_mode)
                except OSError:  # (gone since the folder was listed)
                    continue
                if is_link:
                    links.append((p, key(str(p.relative_to(root)))))
                elif not any(_is_within(os.path.realpath(p), x) for x in excluded):
                    keep.append(d)
            dirnames[:] = keep
            for name in filenames:
                p = Path(dirpath) / name
                k = key(str(p.relative_to(root)))
                try:
                    is_link = stat.S_ISLNK(os.lstat(p).st_mode)
                except OSError as e:
                    if e.errno != errno.ENOENT:  # (gone since the folder was listed: nothing to say)
                        out.append(Candidate(p, k, shown_root, f"cannot read file: {e.strerror}", "unreadable",
                                             is_error=True))
                    continue
                if is_link:
                    links.append((p, k))
                else:
                    out.extend(_candidate(p, k, shown_root, excluded, seen))
        for e in failed:
            out.append(Candidate(Path(e.filename or root), folder_key(e.filename), shown_root,
                                 f"cannot list folder: {e.strerror}", "unlistable_folder", is_error=True))
        for p, k in links:
            out.extend(_candidate(p, k, shown_root, excluded, seen, link_root=real_root))
    taken: set[str] = set()
    for c in out:  # keys are one text per name, but two roots' labels could still meet
        if c.rel in taken:
            n = 2
            while f"{c.rel}~{n}" in taken:
                n += 1
            c.rel = f"{c.rel}~{n}"
        taken.add(c.rel)
    return out


def _unsearchable(entry: Path) -> bool:
    """Whether looking at an entry of a listed folder is refused (the folder lacks search
    permission)."""
    try:
        os.lstat(entry)
    except OSError as e:
        return e.errno in (errno.EACCES, errno.EPERM)
    return False


def searched_roots(inputs: list[str | Path]) -> set[str]:
    """The roots a discovery over these inputs searches, as its candidates record them (an input
    folder, or an input file itself), found files or not."""
    return {display_name(os.path.realpath(inp)) for inp in inputs}


def _candidate(p: Path, rel: str, root: str, excluded: list[str], seen: set,
               link_root: str | None = None) -> list[Candidate]:
    """The outcome of one path (none if its file was reached already); whatever looking at it
    raises is that path's error, not the run's."""
    try:
        return list(_classify(p, rel, root, excluded, seen, link_root))
    except Exception as e:  # noqa: BLE001 -- the per-file boundary
        return [Candidate(p, rel, root, f"{type(e).__name__}: {e}", "internal", is_error=True)]


def _classify(p: Path, rel: str, root: str, excluded: list[str], seen: set, link_root: str | None):
    try:
        st = os.stat(p)  # follows links
    except OSError as e:
        lst = os.lstat(p)
        if ("entry", lst.st_dev, lst.st_ino) in seen:  # a broken link reached twice
            return
        seen.add(("entry", lst.st_dev, lst.st_ino))
        if e.errno == errno.ELOOP:
            yield Candidate(p, rel, root, "symbolic link loop", "broken_link")
        elif p.is_symlink():
            yield Candidate(p, rel, root, "broken symbolic link (its target does not exist)", "broken_link")
        else:
            yield Candidate(p, rel, root, f"cannot read file: {e.strerror}", "unreadable", is_error=True)
        return
    if link_root is not None:
        target = os.path.realpath(p)
        if any(_is_within(target, x) for x in excluded):
            yield Candidate(p, rel, root, "symbolic link into the output folder", "outside_root")
            return
        if not _is_within(target, link_root):
            yield Candidate(p, rel, root, "symlink points outside the input folder", "outside_root")
            return
        if stat.S_ISDIR(st.st_mode):
            return  # a folder inside the root: its files are reached through their real location
    if (st.st_dev, st.st_ino) in seen:
        return
    seen.add((st.st_dev, st.st_ino))
    if not stat.S_ISREG(st.st_mode):
        what = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
        yield Candidate(p, rel, root, f"not a regular file ({what})", "not_a_file")
        return
    suffix = p.suffix.lower()
    if suffix not in PDF_SUFFIXES | IMAGE_SUFFIXES:
        yield Candidate(p, rel, root, f"not a supported document type ({display_name(suffix) or 'no extension'})",
                        "unsupported_type")
        return
    yield Candidate(p, rel, root)


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


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_digest(c: Candidate, max_file_bytes: int = 1 << 30) -> str:
    """The SHA-256 of a document's bytes, after the checks that need no decoding (readable, not
    empty, not over max_file_bytes): what decides whether it is already done."""
    try:
        size = os.stat(c.path).st_size
    except OSError as e:
        raise DocumentError(f"cannot read file: {e.strerror}", "unreadable") from None
    if size == 0:
        raise DocumentError("empty file (0 bytes)", "empty")
    if size > max_file_bytes:
        raise DocumentError(f"file is {size} bytes, over the {max_file_bytes}-byte limit", "too_large")
    try:
        return _sha256_file(c.path)
    except OSError as e:
        raise DocumentError(f"cannot read file: {e.strerror}", "unreadable") from None


def open_document(c: Candidate, *, dpi: int = 120, max_pages: int | None = None,
                  max_pixels: int = DEFAULT_MAX_PIXELS, max_file_bytes: int = 1 << 30,
                  with_text: bool = False, digest: str | None = None) -> Document:
    """Open, validate and hash a document (digest: file_digest's, when the caller has it); page 1
    is rendered here so that a file whose pages cannot be read fails at once with its reason."""
    if digest is None:
        digest = file_digest(c, max_file_bytes)
    doc = _open_pdf(c, digest, dpi, max_pages, max_pixels, with_text) if c.doc_type == "pdf" else \
        _open_image(c, digest, max_pages, max_pixels)
    try:
        doc.page(0)
    except BaseException:
        doc.close()
        raise
    return doc


def _open_pdf(c: Candidate, digest: str, dpi: int, max_pages: int | None, max_pixels: int,
              with_text: bool = False) -> Document:
    import pymupdf

    try:
        name = str(c.path)
        try:
            name.encode("utf-8")
            pdf = pymupdf.open(name, filetype="pdf")
        except UnicodeEncodeError:  # MuPDF takes UTF-8 names only: hand it the bytes
            pdf = pymupdf.open(stream=c.path.read_bytes(), filetype="pdf")
    except OSError as e:
        raise DocumentError(f"cannot read file: {e.strerror}", "unreadable") from None
    except Exception as e:  # pymupdf raises its own FileDataError / RuntimeError variants
        if isinstance(e, getattr(pymupdf, "FileNotFoundError", ())):  # (a RuntimeError: gone since it was found)
            raise DocumentError(f"cannot read file: {os.strerror(errno.ENOENT)}", "unreadable") from None
        raise DocumentError("not a readable PDF: the file is damaged or is not a PDF", "damaged") from None
    if pdf.needs_pass:
        pdf.close()
        raise DocumentError("PDF is encrypted and needs a password", "encrypted")
    if pdf.page_count == 0:
        pdf.close()
        raise DocumentError("PDF has zero pages", "no_pages")

    def render(i: int) -> Page:
        try:
            page = pdf.load_page(i)
            w_in, h_in = page.rect.width / 72.0, page.rect.height / 72.0
            if not (w_in > 0 and h_in > 0):
                raise DocumentError(f"page {i + 1} has no area ({page.rect.width:g} x {page.rect.height:g} pt)",
                                    "render")
            zoom = page_zoom(page.rect.width, page.rect.height, dpi, max_pixels)
            pix = page.get_pixmap(matrix=pymupdf.Matrix(zoom, zoom), alpha=False, colorspace=pymupdf.csRGB)
            text = anchor_text(page) if with_text else None
        except DocumentError:
            raise
        except Exception as e:
            raise DocumentError(f"cannot render page {i + 1}: {e}", "render") from None
        img = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
        return Page(i, img, pixel_hash(img), img.width, img.height, text or None)

    return Document(c, digest, pdf.page_count, max_pages, render, pdf.close)


def page_zoom(width_pt: float, height_pt: float, dpi: int, max_pixels: int) -> float:
    """Pixels per point for a PDF page of this size: dpi / 72, or the whole dpi below it that fits
    max_pixels (a poster-sized page; MuPDF rounds each edge up, so a page may come out a row or
    column over), or, for a page too large even at 1 dpi, the zoom that fits it (within
    max_pixels, whatever size the page claims)."""
    area_in = max(width_pt * height_pt, 1e-6) / 72 ** 2
    if area_in * dpi * dpi <= max_pixels:
        return dpi / 72
    fit = (max_pixels / area_in) ** 0.5
    return int(fit) / 72 if fit >= 1 else fit * 0.999 / 72  # (0.999: a rounded-up edge stays inside)


BOMB_PIXELS = re.compile(r"\((\d+) pixels\)")  # the size in Pillow's decompression-bomb refusal (serve reads it too)


def _bomb_error(e: Exception, max_pixels: int) -> DocumentError:
    """Pillow's decompression-bomb refusal, in our cap's terms (its own limit is another number)."""
    m = BOMB_PIXELS.search(str(e))
    size = f"{int(m.group(1)) / 1e6:.0f} Mpx" if m else "more pixels than Pillow will decode"
    return DocumentError(f"image is {size}, over the {max_pixels / 1e6:.0f} Mpx cap per page "
                         f"(a decompression bomb or an oversized scan)", "too_large")


def _open_image(c: Candidate, digest: str, max_pages: int | None, max_pixels: int) -> Document:
    try:
        with warnings.catch_warnings():  # our cap is checked below, under Pillow's warning threshold
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(c.path)
        frames = getattr(im, "n_frames", 1)
    except Image.DecompressionBombError as e:
        raise _bomb_error(e, max_pixels) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise DocumentError(f"not a readable image: {e}", "damaged") from None

    def render(i: int) -> Page:
        try:
            im.seek(i)
            if im.width * im.height > max_pixels:
                raise DocumentError(
                    f"image {'frame %d ' % (i + 1) if frames > 1 else ''}is {im.width}x{im.height} pixels "
                    f"({im.width * im.height / 1e6:.0f} Mpx), over the {max_pixels / 1e6:.0f} Mpx cap per page",
                    "too_large")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                im.load()
                rgb = to_rgb(im)
                rgb.load()
        except DocumentError:
            raise
        except Image.DecompressionBombError as e:
            raise _bomb_error(e, max_pixels) from None
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise DocumentError(f"not a readable image: {e}", "damaged") from None
        if rgb is im:
            rgb = im.copy()  # the next seek must not change this page's pixels
        # a single image is keyed by its file bytes; frames of a multi-page file by their pixels
        return Page(i, rgb, digest if frames == 1 else pixel_hash(rgb), rgb.width, rgb.height)

    return Document(c, digest, frames, max_pages, render, im.close)

"""Synthetic business documents (invoices and receipts) with ground truth.

    python scripts/make_synthetic_docs.py --out DIR --count N --seed S [--formats pdf,png,jpeg,tiff]
    python scripts/make_synthetic_docs.py --out sample_docs --count 12 --seed 2026 --sample-set

Writes real PDFs drawn with PyMuPDF (text in the base-14 families, tables of line items, rules,
boxes, logos made of shapes; 1 to 3 pages) and "scanned" variants as PNG, JPEG or multi-page TIFF
(the PDF rendered, then a small rotation, blur, noise and JPEG artefacts), plus DIR/truth.jsonl
with one record per document: its fields exactly as printed (every one is in the PDF's text layer)
and normalised (ISO dates, plain decimal totals). Deterministic per seed.
"""
from __future__ import annotations

import argparse
import io
import json
import random
from dataclasses import asdict, dataclass, field
from datetime import date, timedelta
from pathlib import Path

import numpy as np
import pymupdf
from PIL import Image, ImageFilter

import sys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from docproc.pipeline.normalize import format_date, normalize_amount, normalize_date  # noqa: E402

FIELDS = ("vendor", "invoice_number", "date", "due_date", "currency", "total")
FONTS = [("helv", "hebo"), ("tiro", "tibo"), ("cour", "cobo")]  # (regular, bold) base-14 families
VENDOR_A = ["Acme", "Globex", "Initech", "Umbrella", "Stark", "Wayne", "Hooli", "Vandelay", "Soylent", "Tyrell",
            "Cyberdyne", "Wonka", "Nordwind", "Blauberg", "Fjord", "Kestrel", "Brightline", "Oakridge", "Lumen",
            "Polaris", "Redwood", "Saffron", "Quarry", "Meridian", "Halcyon", "Juniper", "Copperfield", "Atlas"]
VENDOR_B = ["Corp", "GmbH", "Ltd", "Inc.", "S.A.", "& Co", "Trading", "Logistics", "Supplies", "Bakery", "Cafe",
            "Hardware", "Consulting", "Print Shop", "Market", "Systems", "AG", "B.V.", "Partners", "Foods"]
PRODUCTS = ["Paper A4 500 sheets", "Toner cartridge", "Consulting hours", "Coffee beans 1kg", "Desk lamp",
            "USB-C cable", "Shipping", "Office chair", "Maintenance fee", "Software licence", "Croissant",
            "Espresso", "Sandwich", "Bolts M6 (100)", "Paint 5L", "Cleaning service", "Label printer",
            "Notebook", "Stapler", "Monitor 27in", "Keyboard", "Travel expenses", "Design work", "Water 0.5L"]
CURRENCIES = ["EUR", "USD", "GBP", "CHF", "SEK", "CAD"]
DATE_FORMATS = ["%Y-%m-%d", "%d.%m.%Y", "%B %d, %Y", "%d %b %Y"]
NUMBER_STYLES = ["en", "de", "fr", "plain"]
TOTAL_LABELS = ["Total", "TOTAL", "Amount due", "Grand total", "Total due"]


def format_amount(value: float, style: str) -> str:
    s = f"{value:,.2f}"  # 1,234.56
    if style == "de":
        return s.replace(",", "_").replace(".", ",").replace("_", ".")
    if style == "fr":
        return s.replace(",", " ").replace(".", ",")
    if style == "plain":
        return s.replace(",", "")
    return s


@dataclass
class DocSpec:
    doc_id: str
    kind: str  # invoice | receipt
    vendor: str
    invoice_number: str
    date: date
    due_date: date | None
    currency: str
    items: list[tuple[str, int, float]]  # description, qty, unit price
    tax_rate: float
    date_format: str
    number_style: str
    total_label: str
    fonts: tuple[str, str]
    font_size: float
    layout: int
    logo: int
    color: tuple[float, float, float]
    printed: dict[str, str | None] = field(default_factory=dict)

    @property
    def subtotal(self) -> float:
        return round(sum(q * p for _, q, p in self.items), 2)

    @property
    def tax(self) -> float:
        return round(self.subtotal * self.tax_rate, 2)

    @property
    def total(self) -> float:
        return round(self.subtotal + self.tax, 2)

    def amount(self, v: float) -> str:
        return format_amount(v, self.number_style)


def make_spec(rng: random.Random, doc_id: str, kind: str | None = None, max_pages: int = 3) -> DocSpec:
    kind = kind or rng.choice(["invoice", "invoice", "receipt"])
    d = date(2020, 1, 1) + timedelta(days=rng.randrange(0, 6 * 365))
    pages = rng.choice([1, 1, 1, 2, 3][: 3 + max_pages - 1] if max_pages > 1 else [1])
    per_page = 22 if kind == "invoice" else 28
    n_items = rng.randint(1, 12) if pages == 1 else rng.randint((pages - 1) * per_page + 1, pages * per_page - 6)
    top = 480.0 if kind == "invoice" else 40.0
    items = [(rng.choice(PRODUCTS), rng.randint(1, 12 if kind == "invoice" else 4), round(rng.uniform(0.5, top), 2))
             for _ in range(n_items)]
    if kind == "invoice":
        number = rng.choice([f"INV-{d.year}-{rng.randint(1, 9999):04d}", f"F{rng.randint(10000, 99999)}",
                             f"{d.year}/{rng.randint(1, 9999):04d}", f"A-{rng.randint(100000, 999999)}"])
        due = d + timedelta(days=rng.choice([7, 14, 30, 45, 60]))
    else:
        number = rng.choice([f"R-{rng.randint(100000, 999999)}", f"{rng.randint(1000, 9999)}-{rng.randint(10, 99)}"])
        due = None
    spec = DocSpec(
        doc_id=doc_id, kind=kind, vendor=f"{rng.choice(VENDOR_A)} {rng.choice(VENDOR_B)}", invoice_number=number,
        date=d, due_date=due, currency=rng.choice(CURRENCIES), items=items,
        tax_rate=rng.choice([0.0, 0.07, 0.1, 0.19, 0.2]), date_format=rng.choice(DATE_FORMATS),
        number_style=rng.choice(NUMBER_STYLES), total_label=rng.choice(TOTAL_LABELS),
        fonts=rng.choice(FONTS), font_size=rng.choice([9, 10, 11, 12]), layout=rng.randrange(2),
        logo=rng.randrange(3), color=(rng.random() * 0.6, rng.random() * 0.6, rng.random() * 0.6),
    )
    spec.printed = {
        "vendor": spec.vendor, "invoice_number": number, "date": format_date(d, spec.date_format),
        "due_date": format_date(due, spec.date_format) if due else None, "currency": spec.currency,
        "total": spec.amount(spec.total),
    }
    return spec


class _Writer:
    """Draws text top-down on a page, starting new pages as needed."""

    def __init__(self, doc: pymupdf.Document, spec: DocSpec, width: float, height: float) -> None:
        self.doc, self.spec, self.width, self.height = doc, spec, width, height
        self.margin = 36 if spec.kind == "invoice" else 14
        self.page = None
        self.new_page()

    def new_page(self) -> None:
        self.page = self.doc.new_page(width=self.width, height=self.height)
        self.y = self.margin + 10

    def text(self, x: float, s: str, size: float | None = None, bold: bool = False, y: float | None = None,
             color=(0, 0, 0), right: bool = False) -> None:
        size = size or self.spec.font_size
        font = self.spec.fonts[1] if bold else self.spec.fonts[0]
        if right:
            x = x - pymupdf.get_text_length(s, fontname=font, fontsize=size)
        self.page.insert_text((x, y if y is not None else self.y), s, fontname=font, fontsize=size, color=color)


def draw_logo(page, spec: DocSpec, x: float, y: float, size: float) -> None:
    r = pymupdf.Rect(x, y, x + size, y + size)
    if spec.logo == 0:
        page.draw_circle(r.tl + (size / 2, size / 2), size / 2, color=spec.color, fill=spec.color)
    elif spec.logo == 1:
        page.draw_rect(r, color=spec.color, fill=spec.color)
        page.draw_rect(pymupdf.Rect(x + size * 0.25, y + size * 0.25, x + size * 0.75, y + size * 0.75),
                       color=(1, 1, 1), fill=(1, 1, 1))
    else:
        page.draw_polyline([(x, y + size), (x + size / 2, y), (x + size, y + size), (x, y + size)],
                           color=spec.color, fill=spec.color, closePath=True)


def draw_pdf(spec: DocSpec) -> pymupdf.Document:
    """The document drawn in memory (training renders from this without serialising it)."""
    doc = pymupdf.open()
    doc.set_metadata({"producer": "docproc synthetic", "creator": "docproc", "title": spec.doc_id})
    if spec.kind == "invoice":
        _draw_invoice(doc, spec)
    else:
        _draw_receipt(doc, spec)
    return doc


def render_pdf(spec: DocSpec) -> bytes:
    return draw_pdf(spec).tobytes(garbage=3, deflate=True, no_new_id=True)


def _meta_lines(spec: DocSpec) -> list[tuple[str, str]]:
    p = spec.printed
    rows = [("Invoice no." if spec.kind == "invoice" else "Receipt no.", p["invoice_number"]), ("Date", p["date"])]
    if p["due_date"]:
        rows.append(("Due date", p["due_date"]))
    rows.append(("Currency", p["currency"]))
    return rows


def _draw_invoice(doc, spec: DocSpec) -> None:
    w = _Writer(doc, spec, 595, 842)
    fs = spec.font_size
    draw_logo(w.page, spec, 36, 30, 34)
    if spec.layout == 0:
        w.text(80, spec.vendor, size=fs + 6, bold=True, y=56, color=spec.color)
        w.text(559, "INVOICE", size=fs + 10, bold=True, y=56, right=True)
        w.y = 100
        for label, value in _meta_lines(spec):
            w.text(360, f"{label}:", bold=True)
            w.text(450, value)
            w.y += fs + 5
    else:
        w.text(297 - pymupdf.get_text_length(spec.vendor, fontname=spec.fonts[1], fontsize=fs + 6) / 2,
               spec.vendor, size=fs + 6, bold=True, y=56, color=spec.color)
        w.text(36, "Invoice", size=fs + 8, bold=True, y=96)
        box = pymupdf.Rect(36, 108, 330, 116 + len(_meta_lines(spec)) * (fs + 5))
        w.page.draw_rect(box, color=(0.3, 0.3, 0.3), width=0.8)
        w.y = 108 + fs + 3
        for label, value in _meta_lines(spec):
            w.text(44, f"{label}: {value}")
            w.y += fs + 5
    w.y = max(w.y, 190) + 10
    w.text(36, "Bill to: Customer " + spec.doc_id.upper(), size=fs - 1)
    w.y += 2 * fs
    _items_table(w, spec, cols=(36, 330, 400, 559))
    _totals(w, spec, x_label=380, x_value=559)


def _draw_receipt(doc, spec: DocSpec) -> None:
    w = _Writer(doc, spec, 240, 640)
    fs = spec.font_size
    draw_logo(w.page, spec, 103, 14, 30)
    w.y = 64
    w.text(120 - pymupdf.get_text_length(spec.vendor, fontname=spec.fonts[1], fontsize=fs + 2) / 2,
           spec.vendor, size=fs + 2, bold=True)
    w.y += 2 * fs
    for label, value in _meta_lines(spec):
        w.text(14, f"{label}: {value}", size=fs - 1)
        w.y += fs + 2
    w.page.draw_line((14, w.y), (226, w.y), color=(0, 0, 0), width=0.6, dashes="[2] 0")
    w.y += fs + 4
    _items_table(w, spec, cols=(14, 150, 160, 226), compact=True)
    _totals(w, spec, x_label=14, x_value=226)


def _items_table(w: _Writer, spec: DocSpec, cols, compact: bool = False) -> None:
    fs = spec.font_size - (1 if compact else 0)
    x_desc, x_qty, x_price, x_amount = cols

    def header():
        if not compact:
            w.text(x_desc, "Description", size=fs, bold=True)
            w.text(x_qty + 40, "Qty", size=fs, bold=True, right=True)
            w.text(x_price + 80, "Unit price", size=fs, bold=True, right=True)
            w.text(x_amount, "Amount", size=fs, bold=True, right=True)
            w.page.draw_line((x_desc, w.y + 4), (x_amount, w.y + 4), color=(0, 0, 0), width=0.8)
            w.y += fs + 8

    header()
    for desc, qty, price in spec.items:
        if w.y > w.height - w.margin - 4 * (fs + 6):
            w.text(x_amount, "continued on next page", size=fs - 2, right=True, y=w.height - w.margin)
            w.new_page()
            header()
        if compact:
            w.text(x_desc, f"{qty} x {desc[:18]}", size=fs)
        else:
            w.text(x_desc, desc, size=fs)
            w.text(x_qty + 40, str(qty), size=fs, right=True)
            w.text(x_price + 80, spec.amount(price), size=fs, right=True)
        w.text(x_amount, spec.amount(qty * price), size=fs, right=True)
        w.y += fs + 5


def _totals(w: _Writer, spec: DocSpec, x_label: float, x_value: float) -> None:
    fs = spec.font_size
    if w.y > w.height - w.margin - 5 * (fs + 6):
        w.new_page()
    w.page.draw_line((x_label, w.y), (x_value, w.y), color=(0, 0, 0), width=0.8)
    w.y += fs + 6
    rows = [("Subtotal", spec.amount(spec.subtotal)),
            (f"Tax {int(round(spec.tax_rate * 100))}%", spec.amount(spec.tax))]
    for label, value in rows:
        w.text(x_label, label)
        w.text(x_value, value, right=True)
        w.y += fs + 5
    w.y += 3
    w.text(x_label, f"{spec.total_label} ({spec.currency})", bold=True, size=fs + 1)
    w.text(x_value, spec.printed["total"], bold=True, size=fs + 1, right=True)
    w.page.draw_rect(pymupdf.Rect(x_label - 4, w.y - fs - 4, x_value + 4, w.y + 5), color=(0.2, 0.2, 0.2), width=0.6)
    w.y += fs + 8


def scan_pages(pdf: "bytes | pymupdf.Document", rng: random.Random, info: list | None = None) -> list[Image.Image]:
    """Render and degrade like a cheap office scanner: rotation, blur, noise, JPEG artefacts."""
    out = []
    doc = pdf if isinstance(pdf, pymupdf.Document) else pymupdf.open(stream=pdf, filetype="pdf")
    nrng = np.random.default_rng(rng.randrange(2**32))
    for page in doc:
        dpi = rng.choice([110, 130, 150])
        pix = page.get_pixmap(dpi=dpi)
        img = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
        page_info = {"dpi": dpi}
        out.append(degrade(img, rng, nrng, info=page_info))
        if info is not None:  # how each page was made (training maps the text layer onto the scan)
            info.append(page_info)
    return out


def degrade(img: Image.Image, rng: random.Random, nrng: np.random.Generator, max_angle: float = 1.5,
            info: dict | None = None) -> Image.Image:
    """Rotation (counter-clockwise, about the image centre; the angle goes into info), blur,
    sensor noise and JPEG artefacts, in that order."""
    angle = rng.uniform(-max_angle, max_angle)
    if info is not None:
        info["angle"] = angle
    img = img.rotate(angle, resample=Image.BICUBIC, fillcolor=(255, 255, 255))
    img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.0, 0.7)))
    arr = np.asarray(img, dtype=np.float32)
    arr += nrng.normal(0.0, rng.uniform(0.0, 8.0), arr.shape[:2])[..., None]
    img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=rng.randint(45, 90))
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def truth_record(spec: DocSpec, file: str, fmt: str, pages: int) -> dict:
    p = spec.printed
    normalized = {"vendor": p["vendor"], "invoice_number": p["invoice_number"], "date": normalize_date(p["date"]),
                  "due_date": normalize_date(p["due_date"]), "currency": p["currency"],
                  "total": normalize_amount(p["total"])}
    return {"id": spec.doc_id, "file": file, "kind": spec.kind, "format": fmt, "pages": pages,
            "fields": dict(p), "normalized": normalized}


def write_document(out: Path, spec: DocSpec, fmt: str, rng: random.Random) -> dict:
    pdf = render_pdf(spec)
    pages = pymupdf.open(stream=pdf, filetype="pdf").page_count
    if fmt == "pdf":
        name = f"{spec.doc_id}.pdf"
        (out / name).write_bytes(pdf)
        return truth_record(spec, name, fmt, pages)
    images = scan_pages(pdf, rng)
    if fmt in ("png", "jpeg") and len(images) > 1:
        fmt = "tiff"  # one image file cannot hold several pages
    ext = {"png": "png", "jpeg": "jpg", "tiff": "tiff"}[fmt]
    name = f"{spec.doc_id}.{ext}"
    if fmt == "tiff":
        images[0].save(out / name, format="TIFF", save_all=True, append_images=images[1:], compression="tiff_deflate")
    elif fmt == "jpeg":
        images[0].save(out / name, format="JPEG", quality=rng.randint(60, 92))
    else:
        images[0].save(out / name, format="PNG", optimize=True)
    return truth_record(spec, name, fmt, len(images))


def generate(out: str | Path, count: int, seed: int, formats=("pdf", "png", "jpeg", "tiff"),
             max_pages: int = 3) -> list[dict]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    weights = {"pdf": 0.5, "png": 0.2, "jpeg": 0.15, "tiff": 0.15}
    fmts = list(formats)
    for i in range(count):
        rng = random.Random(f"docproc-synthetic:{seed}:{i}")
        spec = make_spec(rng, f"doc_{seed}_{i:05d}", max_pages=max_pages)
        fmt = rng.choices(fmts, weights=[weights.get(f, 0.1) for f in fmts])[0]
        records.append(write_document(out, spec, fmt, rng))
    with open(out / "truth.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--formats", default="pdf,png,jpeg,tiff")
    ap.add_argument("--max-pages", type=int, default=3)
    ap.add_argument("--sample-set", action="store_true",
                    help="make sample_docs/: JPEG/TIFF scans, a byte-identical copy and a repeated page")
    a = ap.parse_args()
    if a.sample_set:
        records = make_sample_set(a.out, a.seed, a.count)
    else:
        records = generate(a.out, a.count, a.seed, tuple(a.formats.split(",")), a.max_pages)
    print(f"wrote {len(records)} documents and truth.jsonl to {a.out}")


def make_sample_set(out: str | Path, seed: int = 2026, count: int = 12) -> list[dict]:
    """sample_docs/: `count` generated documents (PDFs and scans, some multi-page), plus a
    byte-identical copy of one file and a PDF that repeats a page of another (dedup shows up in
    the run's figures), with truth.jsonl covering all of them. Scans are JPEG or TIFF to stay small."""
    out = Path(out)
    records = generate(out, count, seed, formats=("pdf", "jpeg", "tiff"))
    first_pdf = next(r for r in records if r["format"] == "pdf")
    copy = dict(first_pdf, id=first_pdf["id"] + "_copy", file=Path(first_pdf["file"]).stem + "_copy.pdf")
    (out / copy["file"]).write_bytes((out / first_pdf["file"]).read_bytes())
    # a cover letter followed by page 1 of another document: the same page in two files
    src = next(r for r in records if r["format"] == "pdf" and r is not first_pdf)
    combined = pymupdf.open()
    cover = combined.new_page(width=595, height=842)
    cover.insert_text((72, 100), "Cover letter", fontname="hebo", fontsize=16)
    cover.insert_text((72, 130), f"Please find attached document {src['id']}.", fontname="helv", fontsize=11)
    with pymupdf.open(out / src["file"]) as s:
        combined.insert_pdf(s, from_page=0, to_page=0)
    name = Path(src["file"]).stem + "_with_cover.pdf"
    combined.set_metadata({"producer": "docproc synthetic", "creator": "docproc", "title": name})
    (out / name).write_bytes(combined.tobytes(garbage=3, deflate=True, no_new_id=True))
    records += [copy, dict(src, id=src["id"] + "_with_cover", file=name, pages=2)]
    # a scanned, multi-page TIFF variant of a multi-page PDF
    multi = next((r for r in records[:count] if r["format"] == "pdf" and r["pages"] > 1), None)
    if multi is not None:
        pages = scan_pages((out / multi["file"]).read_bytes(), random.Random(f"docproc-sample-scan:{seed}"))
        tiff = Path(multi["file"]).stem + "_scan.tiff"
        pages[0].save(out / tiff, format="TIFF", save_all=True, append_images=pages[1:], compression="tiff_deflate")
        records.append(dict(multi, id=multi["id"] + "_scan", file=tiff, format="tiff", pages=len(pages)))
    with open(out / "truth.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return records


if __name__ == "__main__":
    main()

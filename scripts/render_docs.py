"""A document folder for a machine without PyMuPDF (the GPU machine has none): every PDF becomes a
lossless multi-page TIFF of its pages as `docproc run` renders them (the same pixels at --dpi,
under the same pixel cap; the text layer is dropped), every other file is copied, and truth.jsonl
follows the new names (each record keeps its `format`, so `docproc eval` still groups a rendered
PDF with the PDFs). --chunks N splits the documents into N folders (each with its truth.jsonl),
to fit a size limit on what one transfer may carry.

    python3 scripts/render_docs.py DOCS OUT [--dpi 120] [--chunks 3]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from docproc.pipeline.ingest import discover, open_document  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("docs")
    ap.add_argument("out")
    ap.add_argument("--dpi", type=int, default=120)
    ap.add_argument("--chunks", type=int, default=1)
    a = ap.parse_args()
    src, out = Path(a.docs), Path(a.out)
    truth = [json.loads(line) for line in (src / "truth.jsonl").read_text().splitlines() if line.strip()]
    found = {Path(c.path).name: c for c in discover([src])}
    dests = [out / f"part{i}" if a.chunks > 1 else out for i in range(a.chunks)]
    records: list[list[dict]] = [[] for _ in dests]
    for i, rec in enumerate(truth):
        k = i * a.chunks // len(truth)
        dests[k].mkdir(parents=True, exist_ok=True)
        name = Path(rec["file"]).name
        c = found[name]
        if c.doc_type == "pdf":
            doc = open_document(c, dpi=a.dpi)
            try:
                pages = [doc.page(p).image for p in range(doc.num_pages)]
            finally:
                doc.close()
            new = Path(name).stem + ".tiff"
            pages[0].save(dests[k] / new, save_all=True, append_images=pages[1:], compression="tiff_deflate")
            rec = {**rec, "file": new}
        else:
            shutil.copy2(c.path, dests[k] / name)
        records[k].append(rec)
    for d, recs in zip(dests, records):
        (d / "truth.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        size = sum(f.stat().st_size for f in d.iterdir())
        print(f"{d}: {len(recs)} documents, {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()

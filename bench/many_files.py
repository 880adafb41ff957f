"""Host memory against the number of files: `docproc run` over a folder of N small blank page
images (answered without the engine, so the run is the feed, the rows and the parts), against the
same over a handful, each in a fresh process; prints the manifest's peak RSS and the wall time.

    python3 bench/many_files.py --counts 10,10000 --json /tmp/many_files.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="10,10000")
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    from PIL import Image

    work = Path(args.work or tempfile.mkdtemp(prefix="many-files-"))
    page = Image.new("RGB", (200, 260), "white")
    report = []
    for count in (int(c) for c in args.counts.split(",")):
        folder = work / f"in-{count}"
        if not folder.exists():
            folder.mkdir(parents=True)
            for i in range(count):
                page.save(folder / f"f{i:06d}.png")
        out = work / f"out-{count}"
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "docproc", "run", str(folder), "--out", str(out), "--quiet",
                               "--force"], capture_output=True, text=True)
        wall = time.time() - t0
        manifest = json.loads(sorted((out / "runs").glob("*/manifest.json"))[-1].read_text())
        row = {"files": count, "exit_code": proc.returncode, "wall_s": round(wall, 2),
               "documents": manifest["totals"]["documents"],
               "host_max_rss_bytes": manifest["peak_memory"]["host_max_rss_bytes"]}
        report.append(row)
        print(json.dumps(row), flush=True)
    Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

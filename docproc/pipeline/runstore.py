"""The output folder: a lock, results flushed in atomic parts, incremental state, manifests.

Layout of OUT:
  .docproc.lock                 held (flock) for the whole run: a second run exits with code 75
  parts/part-00000042.parquet   results, flushed batch by batch (temp file + rename)
  results.parquet               all parts merged: per path, the rows of its latest part
  json/<path>.json              one file per document
  runs/<run_id>/manifest.json   settings, fingerprints, stage timings, totals, cache figures
A run killed at any point loses at most the batch in flight; the next run reads the parts, skips
every document already done with the same (path, file hash, configuration) and finishes the rest.
"""
from __future__ import annotations

import fcntl
import json
import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from docproc.pipeline.schema import RESULT_SCHEMA, to_table

EXIT_LOCKED = 75


class LockedError(RuntimeError):
    pass


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_table(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".parquet")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def safe_relpath(rel: str) -> Path:
    """A relative path that cannot leave the folder it is joined to."""
    parts = [p for p in Path(rel).parts if p not in ("", ".", "..", "/")]
    return Path(*parts) if parts else Path("_")


class RunStore:
    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        self.parts_dir = self.out / "parts"
        self.runs_dir = self.out / "runs"
        self.json_dir = self.out / "json"
        self._lock_fd: int | None = None

    # ---- lock ------------------------------------------------------------------------------
    def lock(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.out / ".docproc.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockedError(f"another docproc run holds {self.out / '.docproc.lock'}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    # ---- parts -----------------------------------------------------------------------------
    def _part_files(self) -> list[Path]:
        return sorted(self.parts_dir.glob("part-*.parquet")) if self.parts_dir.is_dir() else []

    def next_part(self) -> int:
        files = self._part_files()
        return int(files[-1].stem.split("-")[1]) + 1 if files else 1

    def write_part(self, part: int, rows: list[dict]) -> None:
        for r in rows:
            r["part"] = part
        atomic_write_table(self.parts_dir / f"part-{part:08d}.parquet", to_table(rows))

    def read_all(self) -> pa.Table:
        tables = []
        for f in self._part_files():
            try:
                tables.append(pq.read_table(f, schema=RESULT_SCHEMA))
            except (pa.ArrowInvalid, OSError):
                continue  # a part is only ever renamed into place complete; ignore foreign files
        return pa.concat_tables(tables) if tables else RESULT_SCHEMA.empty_table()

    @staticmethod
    def latest_per_path(table: pa.Table) -> pa.Table:
        """Per path, the rows of its latest part (a redo replaces, never duplicates)."""
        if table.num_rows == 0:
            return table
        paths = table.column("path").to_pylist()
        parts = table.column("part").to_pylist()
        latest: dict[str, int] = {}
        for p, n in zip(paths, parts):
            latest[p] = max(latest.get(p, n), n)
        keep = [i for i, (p, n) in enumerate(zip(paths, parts)) if latest[p] == n]
        return table.take(pa.array(keep, type=pa.int64()))

    def done_keys(self) -> set[tuple[str, str, str]]:
        """(path, file hash, configuration) of every document with a recorded outcome."""
        t = self.latest_per_path(self.read_all())
        keys = set()
        for p, h, c, s in zip(t.column("path").to_pylist(), t.column("doc_sha256").to_pylist(),
                              t.column("config_fingerprint").to_pylist(), t.column("doc_status").to_pylist()):
            if h is not None and s != "skipped":
                keys.add((p, h, c))
        return keys

    def consolidate(self) -> pa.Table:
        """Write results.parquet, then compact the parts into one (the newest number, so rows
        read twice after a crash between the two steps still resolve to one copy)."""
        table = self.latest_per_path(self.read_all())
        table = table.sort_by([("path", "ascending"), ("part", "ascending")])
        atomic_write_table(self.out / "results.parquet", table)
        old = self._part_files()
        if len(old) > 1:
            part = self.next_part()
            compacted = table.set_column(table.schema.get_field_index("part"), "part",
                                         pa.array([part] * table.num_rows, type=pa.int64()))
            atomic_write_table(self.parts_dir / f"part-{part:08d}.parquet", compacted)
            for f in old:
                f.unlink(missing_ok=True)
        return table

    # ---- documents and manifests --------------------------------------------------------------
    def write_document_json(self, rel: str, doc: dict) -> None:
        target = self.json_dir / (str(safe_relpath(rel)) + ".json")
        atomic_write_bytes(target, json.dumps(doc, indent=2, ensure_ascii=False).encode())

    def write_manifest(self, run_id: str, manifest: dict) -> None:
        atomic_write_bytes(self.runs_dir / run_id / "manifest.json", json.dumps(manifest, indent=2).encode())

    def manifests(self) -> list[dict]:
        out = []
        if self.runs_dir.is_dir():
            for d in sorted(self.runs_dir.iterdir()):
                m = d / "manifest.json"
                if m.is_file():
                    try:
                        out.append(json.loads(m.read_text()))
                    except json.JSONDecodeError:
                        continue
        return sorted(out, key=lambda m: m.get("started_at", ""))

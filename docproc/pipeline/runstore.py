"""The output folder: a lock, results flushed in atomic parts, incremental state, manifests.

Layout of OUT (what a reader of OUT sees: the tables, json/, runs/):
  results.parquet               the current results: one set of rows per document under the inputs
  results.csv, results.jsonl    with --format csv / jsonl: the same rows and columns as CSV or JSON lines
  documents.parquet             with --format documents: a row per document, typed per query (typed.py);
                                documents.csv and documents.jsonl beside it where csv / jsonl are asked too
  json/<path>.json              one file per document (a hashed name where the path cannot be one)
  runs/<run_id>/manifest.json   settings, fingerprints, stage timings, totals, cache figures, status
  .docproc/lock                 held (flock) for the whole run: a second run exits with code 75
  .docproc/parts/part-N.rows    results flushed batch by batch (temp file + rename): the state,
                                Parquet files under a suffix no '*.parquet' glob matches
  .docproc/config_cache.json    configuration fingerprints of earlier runs
A table is read by its file name (OUT/results.parquet): the folder as a whole is not a Parquet
dataset, since json/ and runs/ hold JSON files. The state lives in a hidden folder under its own
suffix so that nothing else in OUT looks like results: a glob such as 'OUT/**/*.parquet' (DuckDB,
Polars), which may descend into hidden folders, matches no '.rows' file. Each table file is
rewritten whole at the end of every run once it exists, so that none goes stale. A run killed at
any point loses at most the batch in flight; the next run reads the parts, skips every document
already done with the same (path, file hash, configuration) and finishes the rest. Files are
written with the permissions the umask gives (not mkstemp's 0600). A write that fails for a reason
of the folder (read-only, full, not a folder) raises OutputUnwritable, which stops the run.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from docproc.errors import OutputUnwritable
from docproc.pipeline.schema import RESULT_SCHEMA, document_json, int64_array, read_table, to_table

STATE_DIR = ".docproc"
PART_SUFFIX = ".rows"
REMOVED = "removed"  # doc_status of a tombstone: the document's file is gone from its root
# one path component: 255 bytes on most file systems, 143 on eCryptfs (encrypted home folders),
# the shortest in common use; a JSON name longer than this goes under its hashed name
NAME_MAX_BYTES = 143
JSON_PATH_MAX_BYTES = 1024  # beyond this a JSON file goes under its hashed name
TABLE_FORMATS = ("parquet", "csv", "jsonl")  # the files a table of OUT is written as: TABLE.parquet, ...


PROC_LOCKS = "/proc/locks"


class LockedError(RuntimeError):
    pass


def _holds_open(path: Path, st: os.stat_result) -> bool:
    """Whether the process whose ID the lock file names (a run writes its own) has that file
    open: a live run holding the lock (it closes the file as it unlocks, and an ID used again
    by another process does not have it open). False where /proc cannot say."""
    try:
        pid = int(path.read_bytes()[:32].split()[0])
        fds = os.listdir(f"/proc/{pid}/fd")
    except (OSError, ValueError, IndexError):
        return False
    for fd in fds:
        try:
            other = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def take_lock(path: Path, what: Path | str, holder: str, option: str = "--out") -> int:
    """An exclusive flock on `path` (made if missing): its descriptor. LockedError naming `holder`
    when another process holds it; OutputUnwritable (for `what`, given as `option`) when it
    cannot be made."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise output_fault(e, what, option) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LockedError(f"another {holder} holds {path}") from None
    return fd


class RunInProgress(FileNotFoundError):
    """OUT holds nothing to report yet, and a run holds its lock: its first documents are not
    finished."""


def nothing_yet(out: Path, what: str) -> FileNotFoundError:
    """The error for an OUT with no `what` to report: RunInProgress where a run holds its lock
    (RunStore.locked_by_a_run), else one saying to run docproc run first."""
    if RunStore(out).locked_by_a_run():
        return RunInProgress(f"no {what} in {out} yet: a run is in progress there (its first documents are not "
                             f"finished); try again in a while")
    return FileNotFoundError(f"no {what} in {out}: run `docproc run ... --out {out}` first")


TMP_NAME = re.compile(r"\.tmp-[a-z0-9_]{8}\.[a-z]+")  # _atomic's temporary files (tempfile.mkstemp's names)
DOCUMENT_JSON_KEYS = {"run_id", "path", "doc_sha256", "doc_status", "fields", "queries"}
STRAY_JSON_MAX_BYTES = 64 << 20


def _document_json_of(path: Path, rel: str) -> bool:
    """Whether path (at rel in json/) is a document JSON file docproc wrote for the document
    whose file it is named after."""
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > STRAY_JSON_MAX_BYTES:
            return False
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return (isinstance(doc, dict) and DOCUMENT_JSON_KEYS <= doc.keys() and isinstance(doc["path"], str)
            and rel in (json_relpath(doc["path"]).as_posix(), doc["path"] + ".json"))


def output_fault(e: OSError, what: Path | str, option: str = "--out") -> OutputUnwritable:
    """An OSError from writing OUT (or the file of `option`) as the run-stopping fault, with the
    fix in the message."""
    code = e.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        msg = f"no space left for {what} (disk or quota full): free space and run the same command again"
    elif code == errno.EROFS:
        msg = f"{what} is on a read-only file system: pass a writable {option}"
    elif code in (errno.EACCES, errno.EPERM):
        msg = f"cannot write {what}: permission denied; pass an {option} you may write to"
    elif code == errno.EFBIG:
        msg = (f"cannot write {what}: a file would pass this process's file size limit (`ulimit -f`) or the file "
               f"system's largest file; raise the limit and run the same command again")
    elif code in (errno.ENOTDIR, errno.EEXIST):
        msg = f"cannot write {what}: a file stands where a folder is needed; pass a {'folder' if option == '--out' else 'file'} as {option}"
    else:
        msg = f"cannot write {what}: {e.strerror or e}"
    return OutputUnwritable(msg)


def atomic_write_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write a file whole or not at all (temp file in the same folder, fsync, rename), with the
    permissions the umask gives a new file."""
    _atomic(path, lambda f, tmp: f.write(data), mode)


def atomic_write_table(path: Path, table: pa.Table, mode: int | None = None) -> None:
    """table as Parquet, CSV or JSON lines by path's suffix (.parquet, .csv, .jsonl), atomically."""
    write = {".csv": write_csv, ".jsonl": write_jsonl}.get(path.suffix, lambda t, f: pq.write_table(t, f))
    _atomic(path, lambda f, tmp: write(table, f), mode)


def write_csv(table: pa.Table, f) -> None:
    """table as CSV (RFC 4180, UTF-8): a header of its column names; every string quoted, so that
    an empty string ("") and a null (nothing) stay apart; dates ISO; a nested value (a typed
    struct or list column of documents.parquet) as its JSON text."""
    columns = [_json_text(c) if pa.types.is_nested(c.type) else c for c in table.columns]
    pcsv.write_csv(pa.table(columns, names=table.column_names), f)


def write_jsonl(table: pa.Table, f) -> None:
    """table as JSON lines (UTF-8): one object per row, its keys the column names in order; a null
    is null, a date an ISO string, a struct an object."""
    for batch in table.to_batches(max_chunksize=4096):
        f.write("".join(json.dumps(row, ensure_ascii=False, default=_json_default) + "\n"
                        for row in batch.to_pylist()).encode())


def _json_default(value):
    if hasattr(value, "isoformat"):  # a date32 cell (datetime.date)
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON")


def _json_text(column: pa.ChunkedArray) -> pa.Array:
    return pa.array([None if v is None else json.dumps(v, ensure_ascii=False, default=_json_default)
                     for v in column.to_pylist()], type=pa.string())


def _entries(folder: Path) -> list[os.DirEntry]:
    """folder's entries; none where it cannot be listed (missing, not a folder, no permission)."""
    try:
        with os.scandir(folder) as it:
            return list(it)
    except OSError:
        return []


def _kind(entry: os.DirEntry) -> int | None:
    """The entry's own file type (a link is a link), or None where it cannot be read."""
    try:
        return stat.S_IFMT(entry.stat(follow_symlinks=False).st_mode)
    except OSError:
        return None


def _atomic(path: Path, write, mode: int | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        os.fchmod(fd, 0o666 & ~_umask() if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            write(f, tmp)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_HASHED = re.compile(r"~[0-9a-f]{12}$")
_PART_NAME = re.compile(r"part-\d{8}" + re.escape(PART_SUFFIX))
_OLD_PART_NAME = re.compile(r"part-\d{8}\.parquet")


def _plain_component(part: str, is_dir: bool) -> bool:
    return (part not in ("", ".", "..") and "\\" not in part and part.isprintable()
            and len(part.encode()) + len(".json") <= NAME_MAX_BYTES
            and not (is_dir and part.endswith(".json")) and not _HASHED.search(part))


def _truncate(text: str, max_bytes: int) -> str:
    return text.encode()[:max_bytes].decode("utf-8", "ignore")


def check_out_folder(out: Path) -> None:
    """FileNotFoundError saying why `out` cannot be a run's output folder to read (stats, eval):
    missing, a link that leads nowhere or in a loop, not a folder."""
    if out.is_dir():
        return
    why = ("is a symbolic link that leads nowhere (or in a loop)" if os.path.islink(out) else
           "is not a folder" if os.path.lexists(out) else "does not exist")
    raise FileNotFoundError(f"{out} {why}: name the --out folder of a docproc run")


def json_relpath(key: str) -> Path:
    """The JSON file of a document, relative to json/: the key plus '.json' where every component
    can be a file name; else a name that cannot fail or clash: the key's printable part, cut to
    fit, plus '~' and 12 hex digits of the key's SHA-256 (a key that is too long, holds escaped
    bytes, control characters or '..', or whose folder names end in '.json'). Never outside
    json/: no component is '..' or empty."""
    parts = key.lstrip("/").split("/")  # a key behind an absolute root: under json/ all the same
    if (all(_plain_component(p, i < len(parts) - 1) for i, p in enumerate(parts))
            and len(key.encode()) + len(".json") <= JSON_PATH_MAX_BYTES):
        return Path(*parts[:-1], parts[-1] + ".json")
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    dirs = [p for p in parts[:-1] if _plain_component(p, True)]
    while dirs and len("/".join(dirs).encode()) > JSON_PATH_MAX_BYTES // 2:
        dirs.pop()
    name = "".join(ch if ch.isprintable() and ch not in "/\\" else "_" for ch in parts[-1]).lstrip(".") or "_"
    name = _truncate(name, NAME_MAX_BYTES - 40) + f"~{digest}.json"
    return Path(*dirs, name)


class RunStore:
    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        self.state_dir = self.out / STATE_DIR
        self.parts_dir = self.state_dir / "parts"
        self.runs_dir = self.out / "runs"
        self.json_dir = self.out / "json"
        self.config_cache_path = self.state_dir / "config_cache.json"
        self._lock_fd: int | None = None
        self.damaged_parts: set[Path] = set()  # parts that could not be read (read_all)
        self.unreadable_parts: set[Path] = set()  # parts the system refused to read (read_all): left alone

    # ---- lock ------------------------------------------------------------------------------
    def lock(self) -> None:
        """Take the folder's lock (LockedError if another run holds it); OutputUnwritable if OUT
        cannot be made or written. Parts left by an older layout (OUT/parts) move into the state."""
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise output_fault(e, self.out) from None
        fd = take_lock(self.state_dir / "lock", self.out, "docproc run")
        self._lock_fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            probe = self.state_dir / f".probe-{os.getpid()}"
            probe.write_bytes(b"")  # a folder that takes the lock file but no new file (quota, ro bind)
            probe.unlink()
            self._adopt_old_parts()
        except OSError as e:
            self.unlock()
            raise output_fault(e, self.out) from None

    def locked_by_a_run(self) -> bool:
        """Whether a run holds the folder's lock now, without taking it (taking it, even shared
        for an instant, could turn a run starting then away with exit 75): the kernel's table of
        locks (/proc/locks), else the process whose ID the lock file holds, if it has the lock
        file open (btrfs and overlay file systems give /proc/locks another device number than
        stat, NFS another host). False where neither can be read."""
        path = self.state_dir / "lock"
        try:
            st = os.stat(path)
        except OSError:
            return False
        me = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
        try:
            with open(PROC_LOCKS) as f:
                table = f.read()
        except OSError:
            table = ""
        for line in table.splitlines():
            fields = line.split()
            if "FLOCK" not in fields or len(fields) < 6:
                continue
            try:
                major, minor, inode = fields[fields.index("FLOCK") + 4].split(":")
                if (int(major, 16), int(minor, 16), int(inode)) == me:
                    return True
            except (ValueError, IndexError):
                continue
        return _holds_open(path, st)

    def _adopt_old_parts(self) -> None:
        old = self.out / "parts"
        if not old.is_dir():
            return
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        for f in sorted(old.iterdir()):
            if _OLD_PART_NAME.fullmatch(f.name):
                os.replace(f, self.parts_dir / (f.stem + PART_SUFFIX))
        try:
            old.rmdir()
        except OSError:
            pass  # something else of the user's is in there: leave it

    def unlock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    # ---- parts -----------------------------------------------------------------------------
    def part_files(self) -> list[Path]:
        """The parts, oldest first (a file of another name in the folder is not one); those of the
        older layout (OUT/parts) too, until a run moves them into the state."""
        files = []
        if self.parts_dir.is_dir():
            files += [f for f in self.parts_dir.iterdir() if _PART_NAME.fullmatch(f.name)]
        old = self.out / "parts"
        if old.is_dir():
            files += [f for f in old.iterdir() if _OLD_PART_NAME.fullmatch(f.name)]
        return sorted(files, key=lambda f: f.name)

    def next_part(self) -> int:
        files = self.part_files()
        return int(files[-1].name[5:13]) + 1 if files else 1

    def write_part(self, part: int, rows: list[dict]) -> None:
        for r in rows:
            r["part"] = part
        path = self.parts_dir / f"part-{part:08d}{PART_SUFFIX}"
        try:
            atomic_write_table(path, to_table(rows))
        except OSError as e:
            raise output_fault(e, self.out) from None

    def read_all(self) -> pa.Table:
        tables = []
        for f in self.part_files():
            try:
                if not stat.S_ISREG(os.stat(f).st_mode):  # a FIFO would hold the reader forever
                    self.damaged_parts.add(f)
                    continue
                table = read_table(f, schema=RESULT_SCHEMA)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, KeyError):
                # a part is only ever renamed into place complete: one that is not a table, or whose
                # columns ours do not cast from or are named twice, was damaged since or is a foreign
                # file; its documents are redone, and the run's consolidation sets it aside rather
                # than delete it (a memory error is no verdict on the file: it propagates)
                self.damaged_parts.add(f)
                continue
            except OSError:
                self.unreadable_parts.add(f)  # (unreadable now: a permission, an I/O error) left where it is
                continue
            # every part ever written has had these columns (the schema's first version): a table
            # without them, or with nulls in them, is a foreign file under a part's name
            if any(table.column(fld.name).null_count for fld in RESULT_SCHEMA if not fld.nullable):
                self.damaged_parts.add(f)
                continue
            tables.append(table)
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
        return table.take(int64_array(keep))

    def current(self) -> pa.Table:
        """Every document's latest rows, tombstones (removed documents) dropped."""
        table = self.latest_per_path(self.read_all())
        if table.num_rows:
            keep = [i for i, s in enumerate(table.column("doc_status").to_pylist()) if s != REMOVED]
            if len(keep) < table.num_rows:
                table = table.take(int64_array(keep))
        return table

    def consolidate(self, fill_roots: dict[str, str] | None = None,
                    formats: tuple[str, ...] = ("parquet",)) -> pa.Table:
        """Write results.parquet, results.csv and results.jsonl: each one formats asks for, and
        each one there already (so that none goes stale); then compact the parts into one (the
        newest number, so rows read twice after a crash between the two steps still resolve to
        one copy). Old parts go oldest first, so that a tombstone outlives the rows it removes.
        fill_roots: key -> root for rows stored before roots were recorded."""
        table = self.current().sort_by([("path", "ascending"), ("part", "ascending")])
        if fill_roots:
            roots = [r if r is not None else fill_roots.get(p) for p, r in
                     zip(table.column("path").to_pylist(), table.column("root").to_pylist())]
            table = table.set_column(table.schema.get_field_index("root"), RESULT_SCHEMA.field("root"),
                                     pa.array(roots, type=pa.string()))
        try:
            for fmt in TABLE_FORMATS:
                path = self.out / f"results.{fmt}"
                if fmt in formats or path.exists():
                    atomic_write_table(path, table)
            old = self.part_files()
            # not while a part cannot be read: its rows are not in the table, and renumbering the
            # others above it would make its newer rows lose, its removed documents come back
            if len(old) > 1 and not self.unreadable_parts:
                part = self.next_part()
                compacted = table.set_column(table.schema.get_field_index("part"), "part",
                                             pa.array([part] * table.num_rows, type=pa.int64()))
                atomic_write_table(self.parts_dir / f"part-{part:08d}{PART_SUFFIX}", compacted)
                for f in old:
                    if f not in self.damaged_parts:
                        f.unlink(missing_ok=True)
            for f in sorted(self.damaged_parts):
                if f.exists():
                    f.rename(f.with_name(f.name + ".damaged"))
        except OSError as e:
            raise output_fault(e, self.out) from None
        return table

    def _documents_files(self, formats: tuple[str, ...]) -> list[Path]:
        """The per-document tables to write: documents.parquet when formats has documents, with
        documents.csv and .jsonl where it has csv and jsonl too; and every one there already."""
        paths = []
        for fmt in TABLE_FORMATS:
            path = self.out / f"documents.{fmt}"
            if ("documents" in formats and (fmt == "parquet" or fmt in formats)) or path.exists():
                paths.append(path)
        return paths

    def writes_documents(self, formats: tuple[str, ...]) -> bool:
        return bool(self._documents_files(formats))

    def write_documents(self, table: pa.Table, formats: tuple[str, ...] = ("documents",)) -> None:
        try:
            for path in self._documents_files(formats):
                atomic_write_table(path, table)
        except OSError as e:
            raise output_fault(e, self.out) from None

    # ---- documents and manifests --------------------------------------------------------------
    def own_folders(self) -> list[Path]:
        """The folders a discovery must never enter: OUT, and its json/ where that is a link to
        elsewhere (else a run would read the JSON files it writes as documents)."""
        return [self.out, self.json_dir]

    def json_path(self, rel: str) -> Path:
        return self.json_dir / json_relpath(rel)

    def write_document_json(self, rel: str, doc: dict) -> None:
        try:
            atomic_write_bytes(self.json_path(rel), json.dumps(doc, indent=2, ensure_ascii=False).encode())
        except OSError as e:
            raise output_fault(e, self.out) from None

    def missing_document_json(self, table: pa.Table) -> dict[str, list[dict]]:
        """The documents of table (the current rows) that have no JSON file (deleted by hand, or
        never written: an earlier run without json in --format), with their rows. json/ is
        listed once (a file that is there is not read: a damaged one is written again once
        deleted); a name outside the listing is then checked on its own."""
        present: set[str] = set()
        for dirpath, _, files in os.walk(self.json_dir):
            rel_dir = os.path.relpath(dirpath, self.json_dir)
            present.update(f if rel_dir == "." else f"{rel_dir}/{f}" for f in files)
        paths = table.column("path").to_pylist()
        missing = {p for p in dict.fromkeys(paths) if p + ".json" not in present
                   and json_relpath(p).as_posix() not in present and not self.json_path(p).is_file()}
        rows: dict[str, list[dict]] = {}
        if missing:
            for row in table.take(int64_array([i for i, p in enumerate(paths) if p in missing])).to_pylist():
                rows.setdefault(row["path"], []).append(row)
        return rows

    def write_missing_json(self, missing: dict[str, list[dict]]) -> list[tuple[str, str]]:
        """Write the JSON file of each document of missing_document_json; [(document, why not)]
        for those that could not be (a folder where the file goes, a read-only json/, rows that
        do not make a document)."""
        failed = []
        for rel, doc_rows in missing.items():
            try:
                self.write_document_json(rel, document_json(doc_rows))
            except Exception as e:  # noqa: BLE001 -- one document's file; the rows stand
                failed.append((rel, str(e) if isinstance(e, OutputUnwritable) else f"{type(e).__name__}: {e}"))
        return failed

    def stray_files(self, table: pa.Table) -> list[Path]:
        """Files a run killed between two writes left in OUT: docproc's JSON file of a document
        that has no rows (its JSON renamed into place, then the kill before the part that would
        have recorded it: a file whose content is such a JSON file of the path it stands at), and
        temporary files (`.tmp-` and 8 characters, as `_atomic` names them) wherever it writes: json/,
        the state's folder and its parts, OUT itself (results.*, documents.*) and each run's folder
        (its manifest). Other files in json/ are not ours to remove. None while a part cannot be
        read (its documents' JSON files may be the only readable copy of their answers). Only the
        run that holds the lock calls this: no write of another is under way."""
        if self.unreadable_parts or self.damaged_parts:
            return []
        keys = set(table.column("path").to_pylist())
        ours = {json_relpath(k).as_posix() for k in keys} | {k + ".json" for k in keys}
        # each folder with the suffixes of what docproc writes there (a tool of the user's may name
        # its own temporary files alike)
        folders = [(self.out, (".parquet", ".csv", ".jsonl")), (self.state_dir, (".json",)),
                   (self.parts_dir, None)]
        folders += [(Path(e.path), (".json",)) for e in _entries(self.runs_dir) if _kind(e) == stat.S_IFDIR]
        stray = [Path(e.path) for d, suffixes in folders for e in _entries(d)
                 if TMP_NAME.fullmatch(e.name) and (suffixes is None or Path(e.name).suffix in suffixes)
                 and _kind(e) == stat.S_IFREG]
        for dirpath, _, files in os.walk(self.json_dir):
            rel_dir = os.path.relpath(dirpath, self.json_dir)
            for f in files:
                rel = f if rel_dir == "." else f"{rel_dir}/{f}"
                if rel in ours:
                    continue
                path = Path(dirpath) / f
                if TMP_NAME.fullmatch(f) or _document_json_of(path, rel):
                    stray.append(path)
        return stray

    def remove_stray(self, paths: list[Path]) -> list[tuple[Path, str]]:
        """Remove these files (stray_files); returns those that could not be, with why."""
        failed = []
        for path in paths:
            try:
                path.unlink(missing_ok=True)
            except OSError as e:
                failed.append((path, e.strerror or str(e)))
                continue
            try:
                if path.is_relative_to(self.json_dir):
                    for parent in path.parents:  # folders it leaves empty, up to json/
                        if parent == self.json_dir or not parent.is_relative_to(self.json_dir):
                            break
                        parent.rmdir()
            except OSError:
                pass  # (a folder with other files: as it should be)
        return failed

    def remove_document_json(self, rel: str) -> None:
        path = self.json_path(rel)
        try:
            path.unlink(missing_ok=True)
            for parent in path.parents:  # folders it leaves empty, up to json/
                if parent == self.json_dir or not parent.is_relative_to(self.json_dir):
                    break
                parent.rmdir()
        except OSError:
            pass  # a folder still holding other documents' files (rmdir refuses): as it should be

    def write_manifest(self, run_id: str, manifest: dict) -> None:
        try:
            atomic_write_bytes(self.runs_dir / run_id / "manifest.json", json.dumps(manifest, indent=2).encode())
        except OSError as e:
            raise output_fault(e, self.out) from None

    def read_config_cache(self) -> dict:
        try:
            data = json.loads(self.config_cache_path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):  # none yet, or unreadable: it is only a cache
            return {}

    def write_config_cache(self, cache: dict) -> None:
        try:
            atomic_write_bytes(self.config_cache_path, json.dumps(cache, indent=1).encode())
        except OSError as e:
            raise output_fault(e, self.out) from None

    def manifests(self) -> list[dict]:
        """The readable manifests, oldest run first (read_manifests also says which were not)."""
        return self.read_manifests()[0]

    def read_manifests(self) -> tuple[list[dict], list[dict]]:
        """(manifests, damaged): each runs/<id>/manifest.json that holds a JSON object, oldest run
        first, its run_id filled from its folder where missing; and, for every other one (not
        UTF-8, not JSON, not an object, unreadable), {"run_id", "file", "reason"}. Keys inside a
        manifest are not checked: a reader takes what is there."""
        found, damaged = [], []
        if self.runs_dir.is_dir():
            for d in sorted(self.runs_dir.iterdir()):
                path = d / "manifest.json"
                if not path.is_file():
                    continue
                try:
                    m = json.loads(path.read_bytes().decode("utf-8"))
                except UnicodeDecodeError:
                    reason = "not UTF-8 text"
                except (ValueError, RecursionError) as e:
                    reason = f"not JSON ({e})"
                except OSError as e:
                    reason = f"unreadable ({e.strerror or e})"
                else:
                    if isinstance(m, dict):
                        if not isinstance(m.get("run_id"), str) or not m["run_id"]:
                            m["run_id"] = d.name
                        found.append(m)
                        continue
                    reason = f"{json_kind(m)}, not a JSON object"
                damaged.append({"run_id": d.name, "file": str(path), "reason": reason})
        return sorted(found, key=lambda m: run_order(m["run_id"], m.get("started_at"))), damaged


_RUN_ID_TIME = re.compile(r"(\d{8}T\d{12})Z-")


def run_started_at(run_id: str) -> str | None:
    """A run's start time read from its id (Pipeline makes ids as UTC time + '-' + random hex),
    in the manifests' started_at format; None for an id of another shape."""
    from datetime import datetime, timezone

    m = _RUN_ID_TIME.match(run_id)
    if not m:
        return None
    try:
        t = datetime.strptime(m[1], "%Y%m%dT%H%M%S%f").replace(tzinfo=timezone.utc)
    except ValueError:
        return None
    return t.isoformat(timespec="microseconds")


def run_order(run_id: str, started_at=None) -> tuple[str, str]:
    """Sort key of runs, oldest first: the start time recorded in the manifest, else the one in
    the id; a run with neither sorts before the others (never taken for the latest)."""
    started = started_at if isinstance(started_at, str) else run_started_at(run_id)
    return started or "", run_id


def json_kind(value) -> str:
    """A decoded JSON value's kind as a message names it: "null", "a list", "an object"."""
    if value is None:
        return "null"
    return {bool: "a boolean", str: "a string", int: "a number", float: "a number", list: "a list",
            dict: "an object"}[type(value)]

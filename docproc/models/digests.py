"""The weights' digests remembered between loads.

A model's fingerprint is the SHA-256 of every weight's bytes (models/loader.py). Hashing a 7B
checkpoint's 15 GB takes 8 threads about as long as reading it, so a load that reads it from the
page cache waits for the hashes: the digests of the tensors read straight from a file are kept
here per file, and a later load of the same file, unchanged, takes them instead of hashing again.

"The same file, unchanged" is the one the loader opened having the device, inode, size,
modification time and change time the digests were taken under, and kept them until its last
digest was taken. A write, a truncation, a file renamed over it, `touch` or `chmod` all move the
change time, which no system call can set back (`cp -p` and `rsync -t` keep the modification
time, not the change time). A file changed within `RACY_SECONDS` before it was opened, or while
it was read, is not remembered, since coarse file-system clocks could give its next change the
same times (git's "racily clean" case). Digests are kept under
$XDG_CACHE_HOME/docproc/weight-digests (~/.cache when unset) or the folder
`LLM(weight_digest_cache=...)` names; None keeps none. A cache that cannot be read or written
is ignored: the digests are computed as without it.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path

RACY_SECONDS = 2.0


def default_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "docproc" / "weight-digests"


def resolve_folder(setting: str | None) -> Path | None:
    """EngineConfig.weight_digest_cache (never empty: it checks): "auto" (the user's cache
    folder), a folder, or None (none)."""
    if setting is None:
        return None
    return default_folder() if setting == "auto" else Path(setting)


def identity(fd: int) -> list[int]:
    st = os.fstat(fd)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


MAX_ENTRY_BYTES = 8 << 20  # a 72B checkpoint's shard holds ~100 tensors: ~10 KB of digests
HEX = frozenset("0123456789abcdef")


class DigestCache:
    """Per weights file: {"offset:nbytes": sha256 hex} of the byte ranges hashed from it. An entry
    is read only if it is a regular file (not followed through a link), this user's, writable by
    no one else and at most MAX_ENTRY_BYTES: in a folder others can write to, an entry of theirs
    could name any digests."""

    def __init__(self, folder: Path | None) -> None:
        # (POSIX only: the entry checks need O_NOFOLLOW and a user id)
        self.folder = folder if hasattr(os, "O_NOFOLLOW") and hasattr(os, "getuid") else None

    def _entry(self, path: Path) -> Path:
        name = hashlib.sha256(os.path.realpath(path).encode(errors="surrogateescape")).hexdigest()[:40]
        return self.folder / f"{name}.json"

    def known(self, path: Path, fd: int) -> dict[str, str]:
        """The digests remembered for the file open as fd, if it is the file they were taken from,
        unchanged; else none."""
        if self.folder is None:
            return {}
        try:
            efd = os.open(self._entry(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return {}
        try:
            st = os.fstat(efd)
            if (not stat.S_ISREG(st.st_mode) or st.st_size > MAX_ENTRY_BYTES or st.st_mode & 0o022
                    or st.st_uid != os.getuid()):
                return {}
            data = json.loads(os.read(efd, MAX_ENTRY_BYTES + 1))
            if not isinstance(data, dict) or data.get("identity") != identity(fd):
                return {}
            digests = data.get("digests")
            if not isinstance(digests, dict):
                return {}
            return {k: v for k, v in digests.items()
                    if isinstance(k, str) and isinstance(v, str) and len(v) == 64 and HEX.issuperset(v)}
        except Exception:  # noqa: BLE001 -- (nested too deep, not text, ...): a cache only
            return {}
        finally:
            os.close(efd)

    def remember(self, path: Path, fd: int, opened: list[int], opened_at: int, digests: dict[str, str]) -> None:
        """Keep the digests taken from the file open as fd, if it is as it was when it was opened
        (`opened`, its identity then, at `opened_at`, time.time_ns()) and had not changed in the
        RACY_SECONDS before: a file changed while it was read, or just before, may hold other
        bytes under the same times."""
        if self.folder is None or not digests:
            return
        if identity(fd) != opened or opened_at - max(opened[3], opened[4]) < RACY_SECONDS * 1e9:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd_tmp, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".json")
            try:
                with os.fdopen(fd_tmp, "wb") as f:
                    f.write(json.dumps({"path": os.path.realpath(path), "identity": opened,
                                        "digests": digests}).encode())
                os.replace(tmp, self._entry(path))
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except (OSError, ValueError, UnicodeError):
            pass  # a cache only: the next load hashes again

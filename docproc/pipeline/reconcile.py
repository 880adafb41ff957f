"""The folder as the truth: what an output folder's rows say against what the inputs hold now.

After discovery, every stored document is one of: still there (its key was found again), removed
(its key is gone from a root this run searched: its rows leave results.parquet, its JSON file is
deleted), or out of scope (stored from a root this run did not search: kept as it is). A removed
document whose exact bytes turn up under a new key with the same configuration was renamed: its
rows move to the new key without running the model. Keys under a folder that could not be listed
are never taken as removed (their files were not seen, not deleted).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

# error kinds that say nothing about the file's bytes: such a document is tried again by the next
# run instead of being taken as done (an engine error, such as a prompt over max_model_len, comes
# back with the same bytes and settings: not retried)
RETRY_KINDS = frozenset({"internal"})


@dataclass
class Reconciliation:
    done: set[tuple[str, str, str]] = field(default_factory=set)  # (key, file hash, configuration)
    removed: dict[str, str | None] = field(default_factory=dict)  # key -> its root, gone from the folder
    renamed_from: dict[tuple[str, str], list[dict]] = field(default_factory=dict)  # (hash, config) -> rows
    missing_roots: set[str] = field(default_factory=set)  # keys found with no root recorded
    other_root: dict[str, str] = field(default_factory=dict)  # key found -> the other root OUT holds it from
    skipped: dict[str, str | None] = field(default_factory=dict)  # key -> reason of a stored skip

    def take_rename(self, sha: str, cfg: str) -> list[dict] | None:
        """The rows of a removed document with these bytes and configuration (taken once)."""
        return self.renamed_from.pop((sha, cfg), None)


def stored_file(root: str | None, key: str) -> str | None:
    """The file a stored row names: its root itself where the root is a file input, else the root
    joined with the key (keys behind a root's label, from runs over several roots, name no file
    this way: None is never returned for them, but the path matches nothing)."""
    if root is None:
        return None
    return root if os.path.isfile(root) else os.path.join(root, key)


def reconcile(rows: list[dict], found: dict[str, str], searched_roots: set[str], unlisted: list[str],
              files: dict[str, str] | None = None, default_root: str | None = None) -> Reconciliation:
    """rows: the store's current rows; found: key -> root of every outcome this run's discovery
    made; searched_roots: the roots this run searched; unlisted: key prefixes of folders that
    could not be listed; files: the real path -> key of every document found (a stored row whose
    file is one of them under another key is the same file: its rows move to the new key);
    default_root: the root rows that recorded none (an output folder of the older layout) are
    taken to come from (the run's one root, where it has one)."""
    r = Reconciliation()
    files = files or {}
    by_key: dict[str, list[dict]] = {}
    for row in rows:
        by_key.setdefault(row["path"], []).append(row)
    for key, doc_rows in by_key.items():
        first = doc_rows[0]
        root = first.get("root")
        if root is None and default_root is not None:
            root = default_root
        if key in found:
            if first.get("root") is None:
                r.missing_roots.add(key)
            elif root != found[key] and files.get(stored_file(root, key)) != key:
                r.other_root[key] = root
                continue  # another file: not done, whatever its hash
            if first["doc_sha256"] is not None and first["doc_status"] != "skipped" and \
                    not any(row.get("error_kind") in RETRY_KINDS for row in doc_rows):
                r.done.add((key, first["doc_sha256"], first["config_fingerprint"]))
            elif first["doc_status"] == "skipped":
                r.skipped[key] = first.get("error")
            continue
        same_file = files.get(stored_file(root, key))
        if same_file is None and (root is None or root not in searched_roots
                                  or any(key.startswith(p) for p in unlisted)):
            continue
        r.removed[key] = root  # gone, or the same file found under another key
        if first["doc_sha256"] is not None and first["doc_status"] in ("ok", "partial"):
            r.renamed_from.setdefault((first["doc_sha256"], first["config_fingerprint"]), doc_rows)
    return r

"""The folder as the truth: what an output folder's rows say against what the inputs hold now.

After discovery, every stored document is one of: still there (its key was found again), removed
(its key is gone from a root this run searched: its rows leave results.parquet, its JSON file is
deleted), or out of scope (stored from a root this run did not search: kept as it is). A removed
document whose exact bytes turn up under a new key with the same configuration was renamed: its
rows move to the new key without running the model. Keys under a folder that could not be listed
are never taken as removed (their files were not seen, not deleted).

A document done under another configuration fingerprint is done again, unless every component
that differs is one that cannot reach it (same_answers); ConfigHistory says which components
changed, from the components runs kept (.docproc/fingerprints.json).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass, field

# error kinds that say nothing about the file's bytes: such a document is tried again by the next
# run instead of being taken as done (an engine error, such as a prompt over max_model_len, comes
# back with the same bytes and settings: not retried)
RETRY_KINDS = frozenset({"internal"})


@dataclass
class Reconciliation:
    # key -> (file hash, configuration fingerprint, pages read) of a document done
    done: dict[str, tuple[str, str, int | None]] = field(default_factory=dict)
    removed: dict[str, str | None] = field(default_factory=dict)  # key -> its root, gone from the folder
    # (hash, config) -> the removed documents with those bytes: (rows, the key their file is found
    # under now, or None); several where byte-identical files were removed or renamed
    renamed_from: dict[tuple[str, str], list[tuple[list[dict], str | None]]] = field(default_factory=dict)
    missing_roots: set[str] = field(default_factory=set)  # keys found with no root recorded
    other_root: dict[str, str] = field(default_factory=dict)  # key found -> the other root OUT holds it from
    skipped: dict[str, str | None] = field(default_factory=dict)  # key -> reason of a stored skip

    def take_rename(self, sha: str, cfg: str, key: str | None = None) -> list[dict] | None:
        """The rows of a removed document with these bytes and configuration: the one whose file
        is found under `key` now, else one whose file is gone (each taken once), else a copy of
        one kept for another key found (the same bytes and configuration: the same answers)."""
        entries = self.renamed_from.get((sha, cfg))
        if not entries:
            return None
        pick = next((i for i, (_, now) in enumerate(entries) if now is not None and now == key), None)
        if pick is None:
            pick = next((i for i, (_, now) in enumerate(entries) if now is None), None)
        if pick is None:
            return entries[0][0]
        rows = entries.pop(pick)[0]
        if not entries:
            del self.renamed_from[(sha, cfg)]
        return rows


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
                r.done[key] = (first["doc_sha256"], first["config_fingerprint"], first.get("pages"))
            elif first["doc_status"] == "skipped":
                r.skipped[key] = first.get("error")
            continue
        same_file = files.get(stored_file(root, key))
        if same_file is None and (root is None or root not in searched_roots
                                  or any(key.startswith(p) for p in unlisted)):
            continue
        r.removed[key] = root  # gone, or the same file found under another key
        if first["doc_sha256"] is not None and first["doc_status"] in ("ok", "partial"):
            r.renamed_from.setdefault((first["doc_sha256"], first["config_fingerprint"]), []).append((doc_rows, same_file))
    return r


def fingerprint_of(components: dict) -> str:
    """The configuration fingerprint of these components."""
    return hashlib.sha256(json.dumps(components, sort_keys=True).encode()).hexdigest()[:16]


# components recorded only when on: a fingerprint without one had it off
ABSENT = {"anchor_text": False, "weights_fp8": None, "batch_invariant": False}


def same_answers(old: dict, new: dict, *, pdf: bool, pages: int | None, any_constrained: bool) -> bool:
    """Whether a document done under the configuration components `old` gets the same answers
    under `new`: every component that differs cannot reach it. The constraint mode, when no query
    is constrained; the DPI and anchor text, for a document that is not a PDF (images are not
    rendered and have no text layer); --max-pages, when both limits let every page of it be read
    (pages: the pages it read; fewer than the old limit means all of them)."""
    for k in set(old) | set(new):
        a, b = old.get(k, ABSENT.get(k)), new.get(k, ABSENT.get(k))
        if a == b:
            continue
        if k == "constraints" and not any_constrained:
            continue
        if k in ("dpi", "anchor_text") and not pdf:
            continue
        if k == "max_pages" and pages is not None and (a is None or pages < a) and (b is None or pages <= b):
            continue
        return False
    return True


# how each component is named to a user: the flag that sets it, where there is one
COMPONENT_NAMES = {"queries": "query set", "constraints": "constrained decoding (xgrammar)", "model": "model",
                   "draft": "draft", "dpi": "--dpi", "max_pages": "--max-pages", "kv_cache": "--kv-cache",
                   "dtype": "dtype", "max_image_tokens": "max image tokens", "prompt": "prompt version",
                   "anchor_text": "--anchor-text", "weights_fp8": "FP8 weights",
                   "fp4_value_slots": "FP4 value slots", "batch_invariant": "--batch-invariant"}
# components of options that are gone: a change from a value other than the one every run now has
# says so (no setting brings the old answers back)
REMOVED_OPTIONS = {"fp4_value_slots": (0, "an option docproc no longer has")}


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_shown(v)}" for k, v in sorted(value.items()))
    return str(value)


@dataclass
class ConfigHistory:
    """This run's configuration against the ones OUT's documents were done under."""
    cfg: str  # this run's fingerprint
    components: dict | None  # its components (None where no run kept them)
    known: dict  # fingerprint -> {"components", "query_set"}, as runs kept them
    any_constrained: bool  # a query of this run's set is decoded under a constraint
    query_set: str = ""  # this run's query set's name

    @functools.cached_property
    def _aliases(self) -> set[str]:
        """Fingerprints that differ from this run's only in what reaches no document: without a
        constrained query, the constraint mode (recorded either way before it was held at True)."""
        if self.components is None or self.any_constrained:
            return set()
        return {fingerprint_of({**self.components, "constraints": mode}) for mode in (True, False)}

    def same_answers(self, old_cfg: str, *, pdf: bool, pages: int | None) -> bool:
        """A document done under old_cfg is done under this configuration too."""
        if old_cfg == self.cfg or old_cfg in self._aliases:
            return True
        old = self.known.get(old_cfg)
        return old is not None and self.components is not None and \
            same_answers(old["components"], self.components, pdf=pdf, pages=pages, any_constrained=self.any_constrained)

    def changes(self, old_cfg: str) -> dict[str, list] | None:
        """component -> [before, now] of every component that differs from old_cfg's (a model's
        as model.text, model.vision); None where either side's components were not kept."""
        old = self.known.get(old_cfg)
        if old is None or self.components is None:
            return None
        a, b = _flat(old["components"]), _flat(self.components)
        out = {}
        for k in sorted(set(a) | set(b)):
            before, now = a.get(k, ABSENT.get(k)), b.get(k, ABSENT.get(k))
            if before != now:
                out[k] = [before, now]
        return out

    def describe(self, old_cfg: str) -> str:
        """What changed since old_cfg, in words: "--kv-cache fp32 -> fp4, --dpi 120 -> 150"."""
        changes = self.changes(old_cfg)
        if not changes:  # not kept (or kept under rules that hashed them otherwise)
            return "an earlier configuration"
        labels = (self.known[old_cfg].get("query_set"), self.query_set)
        parts = []
        for k, (before, now) in changes.items():
            head, _, sub = k.partition(".")
            name = COMPONENT_NAMES.get(head, head) + (f" {sub}" if sub else "")
            if head in REMOVED_OPTIONS and before not in (None, REMOVED_OPTIONS[head][0]):
                name += f" ({REMOVED_OPTIONS[head][1]})"
            if k == "queries":
                before, now = (f"{label} ({fp})" if label else fp for label, fp in zip(labels, (before, now)))
            parts.append(f"{name} {_shown(before)} -> {_shown(now)}")
        return ", ".join(parts)


def _flat(components: dict) -> dict:
    out = {}
    for k, v in components.items():
        if isinstance(v, dict):
            out.update({f"{k}.{sub}": x for sub, x in v.items()})
        else:
            out[k] = v
    return out

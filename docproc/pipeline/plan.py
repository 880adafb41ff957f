"""`docproc run --dry-run`: what a run would process, redo, move, remove and skip, and why.

Decided as the run decides it: the same discovery, reconciliation (reconcile.py) and triage
(Pipeline._triage: skips, file hashes, already done, renames), with the configuration fingerprint
from the config cache. Where the cache does not hold it, the model is loaded to compute it only
when some document's outcome turns on it (one done before with the same bytes, or a rename);
loading is what the run would do too, and without it such a document could only be called
"unknown". Nothing is written: OUT is read, never created, locked or written; documents are hashed,
not opened (a file that would fail to render is listed as to be processed).
"""
from __future__ import annotations

from docproc.pipeline.ingest import Candidate, DocumentError, discover, file_digest
from docproc.pipeline.reconcile import ConfigHistory

# what happens to a document, in the order the summary counts them
ACTIONS = ("new", "redo", "already done", "moved", "removed", "skipped", "error")


def dry_run(p) -> dict:
    """The plan of a run of Pipeline p: {"documents": [{"path", "action", "reason"}, ...] (the
    inputs in discovery order, then the documents OUT would drop), "counts": action -> number,
    "config_fingerprint", "fingerprint": {"source": cache | model | not needed, "why"}}."""
    told = p.report
    events: list[dict] = []

    def capture(event: str, data: dict) -> None:
        if event == "document":
            events.append(data)
        else:
            told(event, data)

    p.report = capture
    p._pending = []  # the rows the triage makes (kept here, never written)
    try:
        p.check_models()
        candidates = discover(p.s.inputs, exclude=p.store.own_folders())
        table = p.store.current()
        rows = table.to_pylist()
        p._reconcile(candidates, rows)
        fingerprint = _fingerprint(p, candidates, told)
        p._history = ConfigHistory(p.cfg, p.config_components_known(), p.stored_components(),
                                   bool(p.queries.constrained), p.queries.name)
        stored: dict[str, list[dict]] = {}
        for row in rows:
            stored.setdefault(row["path"], []).append(row)
        plan = []
        for cand in candidates:
            seen = len(events)
            sha = p._triage(cand)
            if sha is not None:
                plan.append(_to_process(p, cand, sha, stored.get(cand.rel)))
            else:
                plan.append(_settled(cand, events[seen] if len(events) > seen else {}))
        moved_from = {e["from"] for e in events if e.get("status") == "moved"}
        for key, root in sorted(p._plan.removed.items()):
            if key not in moved_from:
                plan.append({"path": key, "action": "removed",
                             "reason": f"its file is gone from {root}" if root else "its file is gone"})
    finally:
        p.report = told
    counts = {a: sum(d["action"] == a for d in plan) for a in ACTIONS}
    # documents already done whose JSON file is gone: a completed run writes them from their rows
    done = {d["path"] for d in plan if d["action"] == "already done"}
    json_missing = (sum(path in done for path in p.store.missing_document_json(table))
                    if "json" in p.s.formats and done else 0)
    # what a killed run left behind (a JSON file of a document with no rows, temporary files),
    # which a completed run removes
    stray = len(p.store.stray_files(table))
    return {"documents": plan, "counts": counts, "json_missing": json_missing, "stray_files": stray,
            "config_fingerprint": p.cfg,
            "fingerprint": fingerprint}


def _fingerprint(p, candidates: list[Candidate], told) -> dict:
    """Set p.cfg: from the config cache, or by loading the model where a document's outcome turns
    on it; say which and why."""
    p.cfg = p.cached_config()
    if p.cfg is not None:
        return {"source": "cache", "why": "from the config cache: an earlier run computed it from the same model "
                                          "files and settings"}
    plan = p._plan
    if p.s.force or not (plan.done or plan.renamed_from):
        return {"source": "not needed", "why": "not computed: it is not cached, and no document's outcome turns on "
                                               "it (" + ("--force redoes every document)" if p.s.force else
                                                         "OUT holds nothing done before under these inputs)")}
    renamed = {sha for sha, _ in plan.renamed_from}
    same = 0
    for c in candidates:
        if c.skip_reason or (c.rel not in plan.done and not renamed):
            continue
        try:
            sha = file_digest(c)
        except DocumentError:
            continue  # the triage records it
        same += sha == plan.done.get(c.rel, (None,))[0] or sha in renamed
    if not same:
        return {"source": "not needed", "why": "not computed: it is not cached, and no document done before has "
                                               "the same bytes now"}
    why = (f"computed by loading the model, as the run would: it is not cached (the model files, a setting or "
           f"the query set differ from the runs' in OUT), and whether {same} document(s) done before with the "
           f"same bytes are redone turns on it")
    told("note", {"message": f"the configuration fingerprint is not cached; loading the model to compute it "
                             f"(whether {same} document(s) done before with the same bytes are redone turns on it)"})
    # as the run computes it (RayPipeline: on a worker of the cluster), but kept nowhere: a load
    # that fails is the run's fault too (its exit code)
    p.cfg = p.config_fingerprint()
    return {"source": "model", "why": why}


def _settled(cand: Candidate, event: dict) -> dict:
    """A document the triage settled without the engine, from the event it reported."""
    status = event.get("status")
    if status == "already done":
        return {"path": cand.rel, "action": "already done", "reason": None}
    if status == "moved":
        return {"path": cand.rel, "action": "moved", "reason": f"from {event['from']} (the same bytes)"}
    if status == "skipped":
        return {"path": cand.rel, "action": "skipped", "reason": cand.skip_reason}
    return {"path": cand.rel, "action": "error", "reason": event.get("error") or cand.skip_reason}


def _to_process(p, cand: Candidate, sha: str, rows: list[dict] | None) -> dict:
    """Why a document the triage hands to the engine is done: new, or redone and why."""
    def entry(action: str, reason: str | None) -> dict:
        return {"path": cand.rel, "action": action, "reason": reason}

    plan = p._plan
    if cand.rel in plan.other_root:
        return entry("new", f"OUT holds this path from another input root ({plan.other_root[cand.rel]}): its rows "
                            f"are replaced")
    if not rows:
        return entry("new", None)
    if p.s.force:
        return entry("redo", "--force")
    first = rows[0]
    if first["doc_status"] == "skipped":
        return entry("redo", f"skipped before ({first.get('error')})")
    done = plan.done.get(cand.rel)
    if done is None:  # stored, not done: an error that says nothing about its bytes, or an unread file
        error = next((r.get("error") for r in rows if r.get("error")), None)
        return entry("redo", "an earlier failure is retried" + (f" ({error})" if error else ""))
    if done[0] != sha:
        return entry("redo", "its bytes changed")
    if not p._history.changes(done[1]):  # its components were not kept (a run before fingerprints.json)
        return entry("redo", "the configuration changed since it was done (what changed is not known)")
    return entry("redo", f"the configuration changed ({p._history.describe(done[1])})")

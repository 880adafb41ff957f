"""`docproc stats`: what the runs in an output folder did, from their manifests and the table.

A manifest is written when a run ends; a run killed (kill -9, power loss) or still running has
none, yet its finished documents are in the state's rows. Such a run is reported from its rows
(documents, outcomes, tokens, per-query figures), with the figures only a manifest holds
(seconds, tokens/s, stages) as None. A manifest that cannot be read is skipped and named in
"damaged_manifests"; one with keys missing, null or of the wrong type has those figures None.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pyarrow as pa

from docproc.pipeline.runstore import RunStore, check_out_folder, nothing_yet, run_order, run_started_at
from docproc.pipeline.schema import RESULT_SCHEMA, is_bad, read_table, row_problem

NO_MANIFEST = "no manifest"  # the status of a run known only from its rows
DAMAGED_MANIFEST = "manifest damaged"


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _obj(v) -> dict:
    return v if isinstance(v, dict) else {}


def _str(v):
    return v if isinstance(v, str) else None


def run_row(m: dict) -> dict:
    t = _obj(m.get("totals"))

    def total(key, default=None):
        return _num(t.get(key, default)) if t else None

    return {"run_id": m["run_id"], "started_at": _str(m.get("started_at")), "documents": total("documents"),
            "already_done": total("already_done"), "pages": total("pages"), "unique_pages": total("unique_pages"),
            "generated_tokens": total("generated_tokens"), "tokens_per_second": _num(m.get("tokens_per_second")),
            "acceptance_rate": _num(m.get("acceptance_rate")), "cache_hit_rate": _num(m.get("prefix_cache_hit_rate")),
            "ok": total("ok"), "failures": total("errors"), "partial": total("partial"), "skipped": total("skipped"),
            # counts that manifests written before they existed lack: none moved or removed then
            "moved": total("moved", 0), "removed": total("removed", 0), "seconds": _num(m.get("seconds")),
            "status": _str(m.get("status", "completed"))}


def rows_run_row(run_id: str, rows: list[dict], status: str = NO_MANIFEST) -> dict:
    """A run without a readable manifest, from the rows the table holds of it (its documents that
    no later run redid): run_row's keys, None where only a manifest knows."""
    docs: dict[str, dict] = {}
    sums: dict[str, int] = defaultdict(int)
    for r in rows:
        docs.setdefault(r["path"], r)
        for k in ("generated_tokens", "prompt_tokens", "cached_tokens", "draft_proposed", "draft_accepted"):
            sums[k] += r.get(k) or 0
    outcomes = [d["doc_status"] for d in docs.values()]
    return {"run_id": run_id, "started_at": run_started_at(run_id), "documents": len(docs), "already_done": None,
            "pages": sum(d.get("pages") or 0 for d in docs.values()), "unique_pages": None,
            "generated_tokens": sums["generated_tokens"], "tokens_per_second": None,
            "acceptance_rate": sums["draft_accepted"] / sums["draft_proposed"] if sums["draft_proposed"] else None,
            "cache_hit_rate": round(sums["cached_tokens"] / sums["prompt_tokens"], 4) if sums["prompt_tokens"] else None,
            "ok": outcomes.count("ok"), "failures": outcomes.count("error"), "partial": outcomes.count("partial"),
            "skipped": outcomes.count("skipped"), "moved": None, "removed": None, "seconds": None, "status": status}


WORKER_FIGURES = ("documents", "pages", "unique_pages", "vision_encodes", "generated_tokens", "tokens_per_second",
                  "engine_seconds", "load_seconds", "batches")


def per_worker(m: dict) -> list[dict]:
    """A `docproc run --ray` run's engine workers, each with its figures (none for a plain run)."""
    workers = _obj(m.get("ray")).get("workers")
    return [{"worker": w.get("id"), "node": w.get("node"),
             "gpus": ",".join(str(g) for g in w["gpus"]) or None if isinstance(w.get("gpus"), list) else None,
             **{k: w.get(k) for k in WORKER_FIGURES}}
            for w in (workers if isinstance(workers, list) else []) if isinstance(w, dict)]


def current_rows(out: Path) -> pa.Table:
    """The table as it stands: the state's current rows (they hold a killed run's documents too),
    else results.parquet (an OUT whose state was deleted)."""
    store = RunStore(out)
    if store.part_files():
        return store.current()
    path = out / "results.parquet"
    return read_table(path) if path.is_file() else RESULT_SCHEMA.empty_table()


def per_query(rows: list[dict], run_id: str | None) -> dict:
    """Per query, figures of the rows of run_id (all rows: None). latency_s is a request's time in
    the engine from its arrival to its last token, queueing, prefill and vision encoding included;
    a document read in several windows sums its windows'."""
    acc: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for r in rows:
        if r["query"] is None or (run_id and r["run_id"] != run_id):
            continue
        a = acc[r["query"]]
        a["rows"] += 1
        a["answered"] += r["status"] == "ok"
        a["errors"] += is_bad(r)
        a["generated_tokens"] += r["generated_tokens"] or 0
        a["draft_proposed"] += r["draft_proposed"] or 0
        a["draft_accepted"] += r["draft_accepted"] or 0
        a["draft_verifications"] += r.get("draft_verifications") or 0
        a["latency_s"] += r["latency_s"] or 0.0
    return {q: {"rows": int(a["rows"]), "answered": int(a["answered"]), "errors": int(a["errors"]),
                "mean_generated_tokens": round(a["generated_tokens"] / a["rows"], 2),
                "acceptance_rate": round(a["draft_accepted"] / a["draft_proposed"], 4) if a["draft_proposed"] else None,
                "mean_accepted_length": (round(a["draft_accepted"] / a["draft_verifications"], 3)
                                         if a["draft_verifications"] else None),
                "mean_latency_s": round(a["latency_s"] / a["rows"], 4)} for q, a in sorted(acc.items())}


def collect(out: str | Path, run_id: str | None = None, limit: int = 10) -> dict:
    """The last run (or run_id) in detail, the recent runs, the runs known only from their rows
    ("runs_without_manifest") and the manifests that could not be read ("damaged_manifests")."""
    out = Path(out)
    check_out_folder(out)
    manifests, damaged = RunStore(out).read_manifests()
    rows = current_rows(out).to_pylist()
    by_run: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_run[r["run_id"]].append(r)
    damaged_ids = {d["run_id"] for d in damaged}
    recorded = {m["run_id"] for m in manifests}
    rows_only = [rows_run_row(i, by_run[i], DAMAGED_MANIFEST if i in damaged_ids else NO_MANIFEST)
                 for i in by_run if i not in recorded]
    runs = sorted([(m, run_row(m)) for m in manifests] + [(None, r) for r in rows_only],
                  key=lambda x: run_order(x[1]["run_id"], x[1]["started_at"]))
    if not runs:
        unread = "; ".join(f"{d['file']} is {d['reason']}" for d in damaged)
        if unread:
            raise FileNotFoundError(f"no runs recorded in {out} ({unread}): run `docproc run ... --out {out}` first")
        raise nothing_yet(out, "runs recorded")
    if run_id:
        chosen = [x for x in runs if x[1]["run_id"] == run_id]
        if not chosen:
            raise KeyError(f"run {run_id} is not in {out}; known runs: {', '.join(r['run_id'] for _, r in runs)}")
        m, row = chosen[0]
    else:
        m, row = runs[-1]
    if m is None:
        fingerprints = {r["config_fingerprint"] for r in by_run[row["run_id"]]}
        detail = {"manifest": None, "stage_seconds": None, "dedup": None, "vision_encodes": None, "model": None,
                  "config_fingerprint": fingerprints.pop() if len(fingerprints) == 1 else None,
                  "peak_memory": None, "exit_code": None}
    else:
        detail = {"manifest": str(RunStore(out).runs_dir / m["run_id"] / "manifest.json"),
                  "stage_seconds": m.get("stage_seconds"), "dedup": m.get("dedup"),
                  "vision_encodes": _num(_obj(m.get("dedup")).get("vision_encodes")), "model": m.get("model"),
                  "config_fingerprint": m.get("config_fingerprint"), "peak_memory": m.get("peak_memory"),
                  "exit_code": m.get("exit_code")}
    return {"run": {**row, **detail},
            "per_query": per_query(rows, row["run_id"]),
            "workers": per_worker(m) if m is not None else [],
            "fault": m.get("fault") if m is not None else None,
            "recent_runs": [r for _, r in runs[-limit:]],
            "runs_without_manifest": [r["run_id"] for _, r in runs if r["status"] in (NO_MANIFEST, DAMAGED_MANIFEST)],
            "damaged_manifests": damaged}


def list_failures(out: str | Path) -> list[dict]:
    """Every document of OUT that failed (error) or was answered in part (partial), with its
    reason: the state's current rows, so it holds also when results.parquet was not written."""
    out = Path(out)
    check_out_folder(out)
    store = RunStore(out)
    if not store.part_files() and not (out / "results.parquet").is_file():
        raise nothing_yet(out, "results")
    docs: dict[str, dict] = {}
    for r in store.current().to_pylist():
        if r["doc_status"] not in ("error", "partial"):
            continue
        d = docs.setdefault(r["path"], {"path": r["path"], "status": r["doc_status"], "kind": r.get("error_kind"),
                                        "error": None, "run_id": r["run_id"]})
        if r["error"] and is_bad(r):  # (an answer closed at max_tokens that kept its value is not a reason)
            reason = row_problem(r)
            d["error"] = reason if d["error"] is None else f"{d['error']}; {reason}"
            d["kind"] = d["kind"] or r.get("error_kind") or ("answer" if r["status"] != "error" else None)
    return sorted(docs.values(), key=lambda d: (d["status"] != "error", d["path"]))

"""`docproc stats`: what the runs in an output folder did, from their manifests and the table."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from docproc.pipeline.runstore import RunStore
from docproc.pipeline.schema import read_table


def run_row(m: dict) -> dict:
    t = m["totals"]
    return {"run_id": m["run_id"], "started_at": m["started_at"], "documents": t["documents"],
            "already_done": t["already_done"], "pages": t["pages"], "unique_pages": t["unique_pages"],
            "generated_tokens": t["generated_tokens"], "tokens_per_second": m.get("tokens_per_second"),
            "acceptance_rate": m.get("acceptance_rate"), "cache_hit_rate": m.get("prefix_cache_hit_rate"),
            "failures": t["errors"], "partial": t["partial"], "skipped": t["skipped"],
            "moved": t.get("moved", 0), "removed": t.get("removed", 0), "seconds": m["seconds"],
            "status": m.get("status", "completed")}


WORKER_FIGURES = ("documents", "pages", "unique_pages", "vision_encodes", "generated_tokens", "tokens_per_second",
                  "engine_seconds", "load_seconds", "batches")


def per_worker(m: dict) -> list[dict]:
    """A `docproc run --ray` run's engine workers, each with its figures (none for a plain run)."""
    ray = m.get("ray") or {}
    return [{"worker": w["id"], "node": w.get("node"), "gpus": ",".join(w.get("gpus") or []) or None,
             **{k: w.get(k) for k in WORKER_FIGURES}} for w in ray.get("workers", [])]


def per_query(out: Path, run_id: str | None) -> dict:
    path = out / "results.parquet"
    if not path.is_file():
        return {}
    acc: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    rows = read_table(path).to_pylist()
    for r in rows:
        if r["query"] is None or (run_id and r["run_id"] != run_id):
            continue
        a = acc[r["query"]]
        a["rows"] += 1
        a["answered"] += r["status"] == "ok"
        a["errors"] += r["status"] in ("error", "parse_error")
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
    out = Path(out)
    manifests = RunStore(out).manifests()
    if not manifests:
        raise FileNotFoundError(f"no runs recorded in {out}: run `docproc run ... --out {out}` first")
    if run_id:
        chosen = [m for m in manifests if m["run_id"] == run_id]
        if not chosen:
            raise KeyError(f"run {run_id} is not in {out}; known runs: {', '.join(m['run_id'] for m in manifests)}")
        m = chosen[0]
    else:
        m = manifests[-1]
    return {"run": {**run_row(m), "stage_seconds": m["stage_seconds"], "dedup": m["dedup"],
                    "model": m["model"], "config_fingerprint": m["config_fingerprint"],
                    "peak_memory": m["peak_memory"], "exit_code": m["exit_code"]},
            "per_query": per_query(out, m["run_id"]),
            "workers": per_worker(m),
            "fault": m.get("fault"),
            "recent_runs": [run_row(x) for x in manifests[-limit:]]}


def list_failures(out: str | Path) -> list[dict]:
    """Every document of OUT that failed (error) or was answered in part (partial), with its
    reason: the state's current rows, so it holds also when results.parquet was not written."""
    out = Path(out)
    store = RunStore(out)
    if not store.part_files() and not (out / "results.parquet").is_file():
        raise FileNotFoundError(f"no results in {out}: run `docproc run ... --out {out}` first")
    docs: dict[str, dict] = {}
    for r in store.current().to_pylist():
        if r["doc_status"] not in ("error", "partial"):
            continue
        d = docs.setdefault(r["path"], {"path": r["path"], "status": r["doc_status"], "kind": r.get("error_kind"),
                                        "error": None, "run_id": r["run_id"]})
        if r["status"] in ("error", "parse_error") and r["error"]:
            reason = r["error"] if r["query"] is None else f"{r['query']}: {r['error']}"
            d["error"] = reason if d["error"] is None else f"{d['error']}; {reason}"
            d["kind"] = d["kind"] or r.get("error_kind") or ("answer" if r["status"] == "parse_error" else None)
    return sorted(docs.values(), key=lambda d: (d["status"] != "error", d["path"]))

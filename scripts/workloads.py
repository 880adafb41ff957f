"""Benchmark workloads shared by the scripts (imported with scripts/ on sys.path)."""
from __future__ import annotations

from docproc import SamplingParams
from docproc.pipeline.ingest import discover, open_document
from docproc.pipeline.queries import build_prompt, load_queries


def first_page_queries(docs: str, num_docs: int) -> tuple[list[dict], list[SamplingParams], int]:
    """Every query of the default set on the first page of the first `num_docs` readable
    documents in `docs`, as `docproc run` asks them: greedy, each query's max_tokens, the page's
    SHA-256 as its cache key (so no request re-hashes the pixels). Returns (requests, sampling
    params, documents used)."""
    queries = load_queries().queries
    cands = [c for c in discover([str(docs)]) if not c.skip_reason][:num_docs]
    reqs, params = [], []
    for c in cands:
        doc = open_document(c)
        page = doc.page(0)
        img, sha = page.image, page.sha256
        doc.close()
        for q in queries:
            reqs.append({"prompt": build_prompt(1, q.question), "multi_modal_data": {"image": [img]},
                         "multi_modal_uuids": {"image": [sha]}})
            params.append(SamplingParams(temperature=0.0, max_tokens=q.max_tokens))
    return reqs, params, len(cands)

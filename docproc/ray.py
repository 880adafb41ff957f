"""docproc on Ray: `run`, the Python form of `docproc run --ray`, and `DocprocExtractor`, a
callable class for `Dataset.map_batches` that turns documents into docproc's result rows in a
user's own Ray Data pipeline.

    from docproc.ray import run
    manifest = run(["/data/invoices"], "/data/out", model="/models/qwen2-vl-7b", ray_address="auto")

    import ray
    from docproc.ray import DocprocExtractor

    ds = ray.data.read_binary_files("s3://bucket/invoices/", include_paths=True)
    rows = ds.map_batches(DocprocExtractor, fn_constructor_kwargs={"model": "/models/qwen2-vl-7b"},
                          concurrency=8, num_gpus=1, batch_size=16)
    rows.write_parquet("s3://bucket/extracted/")

Each actor holds one engine (an `LLM` with its own prefix cache) for its life. A batch's
documents go through the same code as `docproc run`: rendering, page hashing and dedup, the query
set and its rules, windows, answer parsing, error rows for files that cannot be read; the rows
are those of results.parquet (RESULT_SCHEMA), with `path` the input row's path. A batch is one
document set for the engine: a document's queries share its pages' prefix, and documents of one
batch that share pages share their encodes. This is a processor for your own pipeline: the
output folder's guarantees of `docproc run` (the lock, incremental skips, crash safety) are not
its business; the rows carry `doc_sha256` and `config_fingerprint` for you to build them.

Input batches need a `path` column (the document's name or path, its suffix telling the format)
and may carry `bytes` (the file's content, as `read_binary_files` gives it); without `bytes` the
actor reads `path` itself (it must see that file system). Ray itself is an optional dependency:
`pip install 'docproc[ray]'`.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pyarrow as pa

from docproc.pipeline.schema import RESULT_SCHEMA, read_table

__all__ = ["DocprocExtractor", "run"]


def run(inputs: list[str] | str, out: str, model: str | None = None, ray_address: str | None = None,
        data_parallel_size: int | None = None, reporter=None, **settings) -> dict:
    """`docproc run INPUTS --out OUT --ray`: the run's manifest (its status and exit_code say how
    it ended). Connects to the cluster at ray_address, or to the one this process has already
    initialised, or starts a local one; settings: any other field of RunSettings (queries,
    device, draft, kv_cache, quantization, dpi, max_pages, formats, force, ...). Raises
    UsageError or QueryFileError before anything is done, LockedError if another run holds OUT."""
    from docproc.pipeline.settings import bundled_model
    from docproc.pipeline.distributed import RayPipeline
    from docproc.pipeline.run import RunSettings

    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if "formats" in settings and isinstance(settings["formats"], str):
        settings["formats"] = tuple(settings["formats"].split(","))
    s = RunSettings(inputs=[str(p) for p in inputs], out=str(out), model=str(model or bundled_model("target")),
                    ray=True, ray_address=ray_address, data_parallel_size=data_parallel_size, **settings)
    return RayPipeline(s, reporter=reporter).run()


class DocprocExtractor:
    def __init__(self, model: str | None = None, queries: str | None = None, device: str = "auto",
                 draft: str | None = None, **settings) -> None:
        """model: a checkpoint folder (the bundled target if None); queries: a query file (the
        default set if None); settings: any other field of docproc's RunSettings (dpi,
        max_pages, kv_cache, quantization, spec_k, ...)."""
        from docproc.pipeline.settings import bundled_model

        self._settings = dict(model=model or str(bundled_model("target")), queries=queries, device=device,
                              draft=draft, **settings)
        self._llm = None  # loaded by the first batch, kept for the actor's life

    def __call__(self, batch) -> pa.Table:
        from docproc.pipeline.run import Pipeline, RunSettings

        paths = [str(p) for p in batch["path"]]
        contents = batch["bytes"] if "bytes" in batch else [None] * len(paths)
        with tempfile.TemporaryDirectory(prefix="docproc-ray-") as tmp:
            inputs = Path(tmp, "in")
            inputs.mkdir()
            names = {}
            for i, (path, data) in enumerate(zip(paths, contents)):
                # one file per input row under a name of its own: two rows with one file name stay two
                name = f"{i:06d}{Path(path).suffix.lower()}"
                if data is None:
                    with open(path, "rb") as f:
                        data = f.read()
                Path(inputs, name).write_bytes(bytes(data))
                names[name] = path
            out = os.path.join(tmp, "out")
            pipeline = Pipeline(RunSettings(inputs=[str(inputs)], out=out, formats=("parquet",), **self._settings),
                                llm=self._llm)
            manifest = pipeline.run()
            self._llm = pipeline.llm
            if manifest["status"] != "completed":  # a fault of the environment: the task fails, named
                raise RuntimeError(f"docproc: {manifest['fault']['message']}")
            table = read_table(os.path.join(out, "results.parquet"))
        rows = table.to_pylist()
        for r in rows:
            r["path"] = names.get(r["path"], r["path"])
            r["root"] = None
        order = {p: i for i, p in reversed(list(enumerate(paths)))}
        rows.sort(key=lambda r: order.get(r["path"], len(paths)))
        return pa.Table.from_pylist(rows, schema=RESULT_SCHEMA)

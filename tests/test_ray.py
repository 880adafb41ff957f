"""docproc.ray.DocprocExtractor in a Ray Data pipeline on a local cluster (2 engine actors on CPU):
the rows equal `docproc run`'s for the same files, a file that cannot be read is an error row and
the rest go on."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from docproc.pipeline.schema import read_table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_docs"
NAMES = ["doc_2026_00001.pdf", "doc_2026_00003.jpg", "doc_2026_00006.jpg", "doc_2026_00002.pdf"]


@pytest.fixture(scope="module")
def cluster():
    # 4 logical CPUs on a 2-core machine: the 2 actors hold one each and the read tasks still run
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_extractor_rows_equal_a_plain_run(cluster, tmp_path):
    from typer.testing import CliRunner

    from docproc.cli import app
    from docproc.ray import DocprocExtractor

    docs = tmp_path / "docs"
    docs.mkdir()
    for n in NAMES:
        shutil.copy(SAMPLES / n, docs / n)
    (docs / "broken.pdf").write_bytes(b"%PDF-1.7 not really")
    res = CliRunner().invoke(app, ["run", str(docs), "--out", str(tmp_path / "out"), "--device", "cpu", "--quiet"])
    assert res.exit_code in (0, 1), res.output
    plain = {(r["path"], r["query"]): r for r in read_table(tmp_path / "out" / "results.parquet").to_pylist()}

    files = sorted(str(p) for p in docs.iterdir())
    ds = ray.data.read_binary_files(files, include_paths=True)
    out = ds.map_batches(DocprocExtractor, fn_constructor_kwargs={"device": "cpu"}, concurrency=2, batch_size=3,
                         num_cpus=1, batch_format="numpy")
    rows = out.take_all()
    got = {(Path(r["path"]).name, r["query"]): r for r in rows}
    assert len(rows) == len(got) == len(plain)  # one row per document x query, no duplicates
    assert set(got) == set(plain)
    for key, r in got.items():
        p = plain[key]
        assert (r["answer"], r["value"], r["status"], r["doc_status"], r["doc_sha256"]) == \
            (p["answer"], p["value"], p["status"], p["doc_status"], p["doc_sha256"]), key
        assert r["config_fingerprint"] == p["config_fingerprint"]
    broken = [r for k, r in got.items() if k[0] == "broken.pdf"]
    assert len(broken) == 1 and broken[0]["doc_status"] == "error" and broken[0]["error"]

"""docproc on a local Ray cluster (2 engine actors on CPU, the bundled model):

- `docproc run --ray --data-parallel-size 2` writes the rows of a plain run (same paths, queries
  and values, no duplicates) and a re-run does no work;
- a worker killed mid-run is restarted and its batch run again; a document that kills its worker
  every time is an error row of kind "worker" after one retry; the other rows are a plain run's,
  and a re-run changes nothing;
- docproc.ray.DocprocExtractor in a user's Ray Data pipeline gives the rows of a plain run;
- a run started from a folder that holds a `docproc` folder imports the installed package on its
  workers; a worker's own error at start is the run's fault, told as the worker raised it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from docproc.pipeline.schema import read_table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_docs"
# doc_2026_00001_copy.pdf is doc_2026_00001.pdf byte for byte: one group, on one engine
NAMES = ["doc_2026_00001.pdf", "doc_2026_00001_copy.pdf", "doc_2026_00003.jpg"]
COMPARED = ("answer", "value", "status", "doc_status", "doc_sha256", "config_fingerprint", "error_kind", "pages")


def _poison_hook():
    """Run in every worker process of the test cluster: opening a file named poison.pdf kills the
    process (SIGKILL), as a crash in a native library would."""
    import os
    import signal

    import docproc.pipeline.feed as feed

    import docproc.engine.llm as llm

    import docproc.pipeline.distributed as distributed

    real = feed.open_document

    def open_document(cand, **kw):  # (an actor renders on a thread: its process dies)
        if cand.rel.endswith("poison.pdf"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(cand, **kw)
    feed.open_document = open_document

    real_init = llm.LLM.__init__

    def init(self, model, *a, **kw):
        # an engine actor (not a task) loading a model folder named dies-loading dies as it loads
        import ray

        if str(model).endswith("dies-loading") and ray.get_runtime_context().get_actor_id() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        real_init(self, model, *a, **kw)
    llm.LLM.__init__ = init

    real_worker = distributed._WorkerPipeline.__init__

    def worker_init(self, settings, *a, **kw):
        # a model folder named raises-starting: a worker raises an ordinary error as it starts (any
        # worker: the task that fingerprints the configuration first); raises-starting-actor: an
        # engine actor does
        import ray

        name = os.path.basename(settings.model)
        if name == "raises-starting" or (name == "raises-starting-actor"
                                         and ray.get_runtime_context().get_actor_id() is not None):
            raise ValueError(f"{name}: a worker's own error")
        real_worker(self, settings, *a, **kw)
    distributed._WorkerPipeline.__init__ = worker_init


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import subprocess
    import sys

    from ray import cloudpickle

    # Ray's workers import docproc as installed: where they cannot, the setup hook below fails in
    # every worker and Ray starts them again without end (the module hung, it did not fail)
    probe = subprocess.run([sys.executable, "-c", "import docproc.pipeline.feed"], capture_output=True, text=True,
                           cwd=tmp_path_factory.mktemp("outside"))
    if probe.returncode != 0:
        pytest.fail("docproc cannot be imported outside the repository, as Ray's workers import it: install it "
                    f"(pip install -e .): {probe.stderr.strip().splitlines()[-1:]}")

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this module
    # 4 logical CPUs on a 2-core machine: the 2 actors hold one each and Ray Data's tasks still run
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"worker_process_setup_hook": _poison_hook})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs")
    for n in NAMES:
        shutil.copy(SAMPLES / n, d / n)
    (d / "broken.pdf").write_bytes(b"%PDF-1.7 not really")
    return d


@pytest.fixture(scope="module")
def plain(docs, tmp_path_factory):
    from typer.testing import CliRunner

    from docproc.cli import app

    out = tmp_path_factory.mktemp("plain")
    res = CliRunner().invoke(app, ["run", str(docs), "--out", str(out), "--device", "cpu", "--quiet"])
    assert res.exit_code == 1, res.output  # broken.pdf
    return out


def _rows(out: Path) -> dict:
    rows = read_table(out / "results.parquet").to_pylist()
    got = {(r["path"], r["query"]): r for r in rows}
    assert len(got) == len(rows)  # one row per document x query: no duplicates
    return got


def _manifest(out: Path) -> dict:
    runs = sorted((out / "runs").iterdir())
    return json.loads((runs[-1] / "manifest.json").read_text())


def _same(got: dict, want: dict, leave_out: set = frozenset()) -> None:
    assert set(got) - leave_out == set(want)
    for key, w in want.items():
        assert tuple(got[key][c] for c in COMPARED) == tuple(w[c] for c in COMPARED), key


def _with_cache(plain: Path, out: Path) -> None:
    """OUT starts with the plain run's configuration cache (the same configuration): no task
    loads the model only to fingerprint it (the die-loading test below takes that path)."""
    (out / ".docproc").mkdir(parents=True)
    shutil.copy(plain / ".docproc" / "config_cache.json", out / ".docproc" / "config_cache.json")


def _ray_run(docs: Path, out: Path, reporter=None, size: int = 2) -> dict:
    from docproc.ray import run

    return run(docs, out, device="cpu", data_parallel_size=size, reporter=reporter)


@pytest.mark.slow
def test_ray_run_rows_equal_a_plain_run_and_a_rerun_does_nothing(cluster, docs, plain, tmp_path):
    from typer.testing import CliRunner

    from docproc.cli import app

    out = tmp_path / "out"
    _with_cache(plain, out)
    args = ["run", str(docs), "--out", str(out), "--device", "cpu", "--quiet", "--ray", "--data-parallel-size", "2"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1, res.output  # broken.pdf, as in the plain run
    want = _rows(plain)
    _same(_rows(out), want)
    assert sorted(p.relative_to(out / "json") for p in (out / "json").rglob("*.json")) == \
        sorted(p.relative_to(plain / "json") for p in (plain / "json").rglob("*.json"))
    m = _manifest(out)
    assert m["status"] == "completed" and m["ray"]["data_parallel_size"] == 2
    assert "fingerprint_load" not in m["stage_seconds"]  # the cached configuration: no probe
    workers = m["ray"]["workers"]
    assert 1 <= len(workers) <= 2 and sum(w["documents"] for w in workers) == m["totals"]["documents"] == 3
    assert m["totals"]["errors"] == 1 and m["totals"]["unique_pages"] == _manifest(plain)["totals"]["unique_pages"]
    assert m["dedup"]["vision_encodes"] == sum(w["vision_encodes"] for w in workers)
    from docproc.pipeline.stats import collect

    assert [w["worker"] for w in collect(out)["workers"]] == [w["id"] for w in workers]  # docproc stats

    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output  # broken.pdf is recorded already
    m2 = _manifest(out)
    assert m2["totals"]["already_done"] == 4 and m2["totals"]["documents"] == 0
    assert not m2["engine_loaded"] and m2["ray"]["workers"] == []
    _same(_rows(out), want)


@pytest.mark.slow
def test_a_killed_worker_is_retried_and_a_document_that_kills_it_twice_fails_alone(cluster, docs, plain, tmp_path):
    mixed = tmp_path / "docs"
    mixed.mkdir()
    kept = ("doc_2026_00003.jpg",)
    for n in kept:
        shutil.copy(docs / n, mixed / n)
    shutil.copy(SAMPLES / "doc_2026_00004.pdf", mixed / "poison.pdf")  # its own bytes: a group of its own
    killed = []

    def reporter(event, data):
        # from outside, as the out-of-memory killer would: the worker that sent the first batch
        if event == "batch" and not killed:
            killed.append(data["worker"]["pid"])
            os.kill(data["worker"]["pid"], signal.SIGKILL)

    out = tmp_path / "out"
    _with_cache(plain, out)
    m = _ray_run(mixed, out, reporter, size=1)  # (one engine actor: it is killed, restarted, killed twice more)
    assert killed and m["status"] == "completed" and m["exit_code"] == 1
    got = _rows(out)
    _same(got, {k: v for k, v in _rows(plain).items() if k[0] in kept}, leave_out={("poison.pdf", None)})
    poison = got[("poison.pdf", None)]
    assert poison["doc_status"] == "error" and poison["error_kind"] == "worker"
    assert "died twice" in poison["error"]
    assert m["ray"]["failed_by_worker"] == 1 and m["ray"]["retried_documents"] >= 1
    assert [f["path"] for f in m["failures"] if f["kind"] == "worker"] == ["poison.pdf"]

    m2 = _ray_run(mixed, out, size=1)  # nothing left to do: the failed document is not run again (--force does)
    assert m2["totals"]["already_done"] == 2 and m2["totals"]["documents"] == 0
    _same(_rows(out), {k: v for k, v in got.items()})


@pytest.mark.slow
def test_extractor_rows_equal_a_plain_run(cluster, docs, plain):
    from docproc.ray import DocprocExtractor

    files = sorted(str(docs / n) for n in ("broken.pdf", "doc_2026_00003.jpg"))
    ds = ray.data.read_binary_files(files, include_paths=True)
    out = ds.map_batches(DocprocExtractor, fn_constructor_kwargs={"device": "cpu"}, concurrency=1, batch_size=2,
                         num_cpus=1, batch_format="numpy")
    rows = out.take_all()
    got = {(Path(r["path"]).name, r["query"]): r for r in rows}
    assert len(rows) == len(got)
    _same(got, {k: v for k, v in _rows(plain).items() if k[0] in {Path(f).name for f in files}})
    broken = got[("broken.pdf", None)]
    assert broken["doc_status"] == "error" and broken["error"]


@pytest.mark.slow
def test_workers_that_die_loading_the_model_stop_the_run_and_mark_nothing(cluster, docs, tmp_path):
    """Engine actors that die as they load (out of memory, say) are a fault of the environment:
    the run stops with exit 4 and a manifest, and no document is recorded as failed."""
    from docproc.pipeline.settings import bundled_model
    from docproc.ray import run

    model = tmp_path / "dies-loading"
    model.symlink_to(bundled_model("target"))
    out = tmp_path / "out"
    m = run(docs, out, model=str(model), device="cpu", data_parallel_size=1)
    assert m["status"] == "failed" and m["exit_code"] == 4, (m["fault"], m["ray"], m["stage_seconds"])
    assert "while loading the model" in m["fault"]["message"]
    assert m["totals"]["documents"] == 0 and not [f for f in m["failures"] if f["kind"] == "worker"]
    from docproc.pipeline.runstore import RunStore

    assert not [r for r in RunStore(out).current().to_pylist() if r["error_kind"] == "worker"]


def test_ray_init_leaves_the_runs_signal_handlers(monkeypatch, tmp_path):
    """ray.init installs its own SIGTERM handler; the run's must stay, so that SIGTERM still ends
    the run with a manifest (exit 143)."""
    from docproc.pipeline.settings import bundled_model
    from docproc.pipeline.distributed import RayPipeline
    from docproc.pipeline.run import RunSettings

    def fake_init(**kw):
        signal.signal(signal.SIGTERM, lambda *a: None)
        signal.signal(signal.SIGINT, lambda *a: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0})
    monkeypatch.setattr(ray, "nodes", lambda: [{}])
    (tmp_path / "in").mkdir()
    p = RayPipeline(RunSettings(inputs=[str(tmp_path / "in")], out=str(tmp_path / "out"),
                                model=str(bundled_model("target")), device="cpu", ray=True))
    ours = lambda *a: None  # noqa: E731
    before = {sig: signal.signal(sig, ours) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        p._cluster()
        assert signal.getsignal(signal.SIGTERM) is ours and signal.getsignal(signal.SIGINT) is ours
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)
    assert p._size == 1 and p._gpus == 0


@pytest.mark.parametrize("name,told", [
    ("raises-starting", "the Ray worker that loads the model to fingerprint this configuration failed: ValueError: "
                        "raises-starting: a worker's own error"),
    ("raises-starting-actor", "an engine worker failed as it started: ValueError: raises-starting-actor: a worker's "
                              "own error")], ids=["task", "actor"])
@pytest.mark.slow
def test_a_workers_own_error_at_start_is_told_as_it_was_raised(cluster, docs, tmp_path, name, told):
    from docproc.pipeline.settings import bundled_model
    from docproc.ray import run

    model = tmp_path / name
    model.symlink_to(bundled_model("target"))
    m = run(docs, tmp_path / "out", model=str(model), device="cpu", data_parallel_size=1)
    assert m["status"] == "failed" and m["exit_code"] == 4
    assert m["fault"]["message"] == told  # one line: no terminal colours, no traceback, no "died twice"


@pytest.mark.slow
def test_a_docproc_folder_in_the_working_folder_does_not_shadow_the_package(tmp_path):
    """Ray puts the driver's working folder on its workers' sys.path: started from a folder that
    holds a `docproc` folder (a clone of the repository, run from its parent), the workers
    imported that folder instead of the installed package. The run's own cluster start, from such
    a folder, then a task that imports docproc on a worker."""
    import subprocess
    import sys

    here = tmp_path / "home"
    (here / "docproc").mkdir(parents=True)
    (here / "docproc" / "__init__.py").write_text("raise ImportError('the docproc folder in the working folder')\n")
    (tmp_path / "in").mkdir()
    script = tmp_path / "start.py"  # (a script's own folder, not the working folder, is on the driver's path)
    script.write_text(
        "import ray\n"
        "from docproc.pipeline.distributed import RayPipeline\n"
        "from docproc.pipeline.settings import RunSettings\n"
        f"s = RunSettings(inputs=[{str(tmp_path / 'in')!r}], out={str(tmp_path / 'out')!r}, model='unused', "
        "device='cpu', ray=True)\n"
        "RayPipeline(s)._cluster()\n"
        "@ray.remote\n"
        "def where():\n"
        "    import docproc.pipeline.distributed, docproc\n"
        "    return docproc.__file__\n"
        "print(ray.get(where.remote()))\n"
        "ray.shutdown()\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=here, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(ROOT / "docproc" / "__init__.py")


def test_a_probe_that_raised_is_told_by_its_own_error_and_one_that_died_as_died_twice():
    from docproc.pipeline.distributed import _probe_failure

    raised = ray.exceptions.RayTaskError(
        "_probe", "Traceback (most recent call last):\n  ...\nImportError: cannot import name 'x'",
        ImportError("cannot import name 'x' from 'docproc' (unknown location)"))
    assert "\x1b[" in str(raised)  # Ray's own text is coloured for a terminal
    told = _probe_failure(raised)
    assert told == ("the Ray worker that loads the model to fingerprint this configuration failed: ImportError: "
                    "cannot import name 'x' from 'docproc' (unknown location); install docproc the same way on "
                    "every node of the cluster")
    died = _probe_failure(ray.exceptions.WorkerCrashedError())
    assert "died twice" in died and "WorkerCrashedError" in died and "\x1b[" not in died

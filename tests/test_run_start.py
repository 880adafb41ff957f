"""A run's start: with nothing to do it imports no torch; SIGTERM and SIGINT during the imports and
the model load end it with a manifest; documents redone because the configuration changed are
counted and explained, and a change that cannot reach a document does not redo it."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from docproc import cli
from docproc.cli import app
from docproc.pipeline.reconcile import ConfigHistory, fingerprint_of, same_answers
from docproc.pipeline.runstore import RunStore
from docproc.pipeline.signals import RunInterrupted, importing, signals_raise

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_docs"
HEAVY = ("torch", "transformers", "pandas", "xgrammar", "triton", "safetensors")
COMPONENTS = {"queries": "a78bbd47f1ba5d5a", "constraints": True, "model": {"text": "69ba", "vision": "671d"},
              "draft": None, "dpi": 120, "max_pages": None, "kv_cache": "fp32", "dtype": "float32",
              "max_image_tokens": 16384, "prompt": "v1"}


def _docs(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True)
    for name in names:
        shutil.copy(SAMPLES / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def done_once(tmp_path_factory, one_query):
    """A JPEG and a PDF done by the bundled model (the output folder, to be copied)."""
    base = tmp_path_factory.mktemp("done")
    docs = _docs(base / "in", "doc_2026_00003.jpg", "doc_2026_00002.pdf")
    out = base / "out"
    res = CliRunner().invoke(app, ["run", str(docs), "--out", str(out), "--queries", str(one_query)])
    assert res.exit_code == 0, res.output
    return docs, out


def _manifest(out: Path) -> dict:
    return RunStore(out).manifests()[-1]


# ---- a run with nothing to do ---------------------------------------------------------------------
@pytest.mark.slow
def test_a_run_with_nothing_to_do_imports_no_torch(done_once, one_query, tmp_path):
    docs, done = done_once
    out = tmp_path / "out"
    shutil.copytree(done, out)
    args = ["run", str(docs), "--out", str(out), "--queries", str(one_query), "--quiet"]
    script = ("import json, os, sys\nfrom docproc import cli\nsys.argv = ['docproc'] + json.loads(sys.argv[1])\n"
              "def leave(code):\n"
              f"    print(json.dumps({{'code': code, 'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))\n"
              "    cli.__dict__['_leave_now'](code)\n"
              "cli.__dict__['_leave_now'], cli._leave = cli._leave, leave\n"
              "import atexit\natexit.register(print, 'teardown')\ncli.entry()")
    res = subprocess.run([sys.executable, "-c", script, json.dumps(args)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    # the run's end leaves the process at once (no Python teardown: about 1 s of every run), its
    # output flushed
    assert json.loads(res.stdout.splitlines()[-1]) == {"code": 0, "heavy": []}, res.stderr
    assert "teardown" not in res.stdout
    m = _manifest(out)
    assert m["totals"]["already_done"] == 2 and not m["engine_loaded"] and m["config_changed"] is None


def test_main_in_process_ends_in_system_exit_after_a_run_too(monkeypatch):
    """Only the command's entry leaves the process at a run's end: main() called in-process (a
    wrapper, a test) raises SystemExit as before, also after a run in that process."""
    monkeypatch.setattr(cli, "_run_ended", True)  # (as a run in this process left it)
    monkeypatch.setattr(sys, "argv", ["docproc", "--help"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 0 and cli._run_ended is False


@pytest.mark.slow
def test_what_a_killed_run_left_between_two_writes_is_removed_by_the_next(done_once, one_query, tmp_path):
    """kill -9 after a document's JSON file was renamed into place and before the part that
    records its rows leaves a JSON file with no rows (and temporary files): the next completed
    run removes them and says so. Every document's own JSON file stays, and so do other files in
    json/ (docproc's JSON of another path's name, a user's index)."""
    docs, done = done_once
    out = tmp_path / "out"
    shutil.copytree(done, out)
    own = sorted(p.relative_to(out / "json") for p in (out / "json").rglob("*.json"))
    assert len(own) == 2
    doc = json.loads((out / "json" / own[0]).read_text())
    for path in ("gone.pdf", "sub/gone.png"):  # what a killed run renamed into place
        (out / "json" / path).parent.mkdir(exist_ok=True)
        (out / "json" / (path + ".json")).write_text(json.dumps({**doc, "path": path}))
    (out / "json" / ".tmp-abcdefgh.json").write_text("{")
    (out / ".docproc" / "parts" / ".tmp-ijklmnop.rows").write_bytes(b"PAR1")
    # and wherever else _atomic writes: OUT (results.*, documents.*), the state, a run's folder
    run_dir = next((out / "runs").iterdir())
    tmps = [out / ".tmp-qrstuvwx.parquet", out / ".tmp-a1b2c3d4.csv", out / ".docproc" / ".tmp-e5f6g7h8.json",
            run_dir / ".tmp-i9j0k1l2.json"]
    for t in tmps:
        t.write_bytes(b"x")
    (out / ".tmp-notours.parquet").write_bytes(b"x")  # (not _atomic's name: left alone)
    (out / ".tmp-abcdefgh.txt").write_bytes(b"x")  # (nothing docproc writes there)
    kept = {"index.json": "{}", "notes/config.json": json.dumps({**doc, "path": "elsewhere.pdf"})}
    for name, text in kept.items():
        (out / "json" / name).parent.mkdir(exist_ok=True)
        (out / "json" / name).write_text(text)
    args = ["run", str(docs), "--out", str(out), "--queries", str(one_query)]
    plan = CliRunner().invoke(app, [*args, "--dry-run", "--log-json"])
    assert json.loads(plan.stdout.splitlines()[-1])["stray_files"] == 8, plan.output
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "removing 8 file(s) an interrupted run left" in res.output and "2 JSON file(s) of documents with no rows" in res.output
    assert sorted(p.relative_to(out / "json") for p in (out / "json").rglob("*") if p.is_file()) == \
        sorted(own + [Path(name) for name in kept])
    assert not (out / "json" / "sub").exists() and not list((out / ".docproc" / "parts").glob(".tmp-*"))
    assert not any(t.exists() for t in tmps) and (out / ".tmp-notours.parquet").exists()
    assert (out / ".tmp-abcdefgh.txt").exists()


def test_stray_files_skip_what_cannot_be_listed_and_say_what_could_not_be_removed(tmp_path, monkeypatch):
    """A folder that cannot be listed (runs/ without read permission, a run folder gone) is passed
    over, not an error at the end of a completed run; a file that cannot be removed is returned
    with why (the run warns), the others are removed."""
    import pyarrow as pa

    import docproc.pipeline.runstore as runstore

    store = RunStore(tmp_path / "out")
    for d in (store.out, store.parts_dir, store.runs_dir / "a", store.runs_dir / "b"):
        d.mkdir(parents=True, exist_ok=True)
    files = [store.out / ".tmp-aaaaaaaa.parquet", store.runs_dir / "a" / ".tmp-bbbbbbbb.json",
             store.runs_dir / "b" / ".tmp-cccccccc.json"]
    for f in files:
        f.write_bytes(b"x")
    (store.runs_dir / "a" / ".tmp-dddddddd.json").symlink_to(files[0])  # (a link is not a file of ours)
    table = pa.table({"path": pa.array([], pa.string())})
    real = os.scandir

    def scandir(path):
        if Path(path) == store.runs_dir / "b":
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(runstore.os, "scandir", scandir)
    assert sorted(store.stray_files(table)) == sorted(files[:2])
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        if self == files[1]:
            raise PermissionError(13, "Permission denied")
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    assert store.remove_stray(files[:2]) == [(files[1], "Permission denied")]
    assert not files[0].exists() and files[1].exists()


@pytest.mark.slow
def test_a_run_stopped_after_a_move_holds_the_document_once(one_query, tmp_path, monkeypatch):
    """A renamed file's rows move to its new key in one part with the old key's removal: a run
    stopped after that part (before the removals a whole run writes at its end) leaves the
    document once, under its new name, with one JSON file (it was under both)."""
    from docproc.pipeline.run import Pipeline

    docs, out = _docs(tmp_path / "in", "doc_2026_00003.jpg"), tmp_path / "out"
    args = ["run", str(docs), "--out", str(out), "--queries", str(one_query)]
    assert CliRunner().invoke(app, args).exit_code == 0
    (docs / "doc_2026_00003.jpg").rename(docs / "renamed.jpg")

    def stopped(self):
        raise RunInterrupted(signal.SIGTERM)

    monkeypatch.setattr(Pipeline, "_remove_gone", stopped)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 143 and "(1 renamed file(s) moved)" in res.output, res.output
    assert _manifest(out)["totals"]["moved"] == 1
    assert set(RunStore(out).current().column("path").to_pylist()) == {"renamed.jpg"}
    assert [p.name for p in (out / "json").rglob("*.json")] == ["renamed.jpg.json"]


# ---- documents redone because the configuration changed ----------------------------------------------
@pytest.mark.slow
def test_a_setting_change_redoes_only_the_documents_it_reaches_and_says_what_changed(done_once, one_query,
                                                                                    tmp_path):
    docs, done = done_once
    out = tmp_path / "out"
    shutil.copytree(done, out)
    before = _manifest(out)["config_fingerprint"]
    res = CliRunner().invoke(app, ["run", str(docs), "--out", str(out), "--queries", str(one_query), "--dpi", "100"])
    assert res.exit_code == 0, res.output
    # the PDF is rendered at the new DPI; the JPEG is not rendered at all: it stays done
    assert "1 document(s) done before are redone: the configuration changed (--dpi 120 -> 100)" in res.output
    m = _manifest(out)
    assert m["totals"]["already_done"] == 1 and m["totals"]["documents"] == 1
    assert m["config_changed"] == {"documents": 1, "from": [
        {"config_fingerprint": before, "documents": 1, "changed": {"dpi": [120, 100]}}]}


def test_components_that_cannot_reach_a_document_do_not_redo_it():
    def same(old, new, pdf=True, pages=3, any_constrained=True):
        return same_answers({**COMPONENTS, **old}, {**COMPONENTS, **new}, pdf=pdf, pages=pages,
                            any_constrained=any_constrained)

    assert same({}, {})
    assert not same({"dpi": 120}, {"dpi": 150}) and same({"dpi": 120}, {"dpi": 150}, pdf=False)
    assert not same({}, {"anchor_text": True}) and same({}, {"anchor_text": True}, pdf=False)
    assert not same({"constraints": False}, {}) and same({"constraints": False}, {}, any_constrained=False)
    # --max-pages: the same pages read under both limits (3 pages of 3, read whole each time)
    assert same({"max_pages": None}, {"max_pages": 5}) and same({"max_pages": 10}, {"max_pages": 3})
    assert not same({"max_pages": 3}, {"max_pages": 5})  # 3 read of perhaps more
    assert not same({"max_pages": None}, {"max_pages": 2}) and not same({}, {"max_pages": 5}, pages=None)
    assert not same({"kv_cache": "fp32"}, {"kv_cache": "fp4"}, pdf=False)
    assert not same({"model": {"text": "1", "vision": "2"}}, {}, pdf=False)
    # --batch-invariant sums in its own order: every document is redone; off is what an entry-less one had
    assert not same({}, {"batch_invariant": True}, pdf=False) and same({"batch_invariant": False}, {})


def test_config_history_names_what_changed_and_takes_older_fingerprints_of_a_no_op_mode():
    new = {**COMPONENTS, "kv_cache": "fp4", "fp4_value_slots": 0, "anchor_text": True}
    old = {**COMPONENTS, "queries": "0011"}
    known = {"old": {"components": old, "query_set": "invoices"}}
    h = ConfigHistory(fingerprint_of(new), new, known, any_constrained=True, query_set="receipts")
    assert h.changes("old") == {"anchor_text": [False, True], "fp4_value_slots": [None, 0],
                                "kv_cache": ["fp32", "fp4"], "queries": ["0011", "a78bbd47f1ba5d5a"]}
    assert h.describe("old") == ("--anchor-text off -> on, FP4 value slots none -> 0, --kv-cache fp32 -> fp4, "
                                 "query set invoices (0011) -> receipts (a78bbd47f1ba5d5a)")
    assert h.describe("never-kept") == "an earlier configuration" and h.changes("never-kept") is None
    slots = ConfigHistory(fingerprint_of(new), new, {"two": {"components": {**new, "fp4_value_slots": 2}}},
                          any_constrained=True)
    assert slots.describe("two") == "FP4 value slots (an option docproc no longer has) 2 -> 0"
    assert not h.same_answers("old", pdf=False, pages=1)
    # no constrained query: a fingerprint made with the mode off (as runs without xgrammar made
    # them, with or without components kept) is this configuration
    off = fingerprint_of({**COMPONENTS, "constraints": False})
    loose = ConfigHistory(fingerprint_of(COMPONENTS), COMPONENTS, {}, any_constrained=False)
    strict = ConfigHistory(fingerprint_of(COMPONENTS), COMPONENTS, {}, any_constrained=True)
    assert loose.same_answers(off, pdf=True, pages=1) and not strict.same_answers(off, pdf=True, pages=1)


# ---- signals during the start --------------------------------------------------------------------
def test_a_signal_during_an_import_is_raised_after_it(tmp_path, monkeypatch):
    """The module's import sends SIGTERM to its own process and goes on; RunInterrupted comes once
    the import is whole (raised inside it, a C extension's start-up would be cut in half)."""
    (tmp_path / "slow_module_for_signals.py").write_text(
        "import os, signal, sys, time\n"
        "from docproc.pipeline.signals import importing\n"
        "INSIDE = importing(sys._getframe())\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "t = time.time()\n"
        "while time.time() - t < 0.2:\n"
        "    pass\n"
        "DONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not importing(sys._getframe())
    with pytest.raises(RunInterrupted) as e:
        with signals_raise():
            import slow_module_for_signals  # noqa: F401
            while True:  # the signal is raised here, within DEFER_POLL_S
                time.sleep(0.001)
    module = sys.modules.pop("slow_module_for_signals")
    assert module.INSIDE and module.DONE and e.value.signum == signal.SIGTERM


def test_a_signal_that_c_code_swallowed_is_raised_again():
    """A RunInterrupted raised in a Python callback of C code comes out as that code's own error
    (torch, as a model loads: "could not determine the shape of object type ..."): the run's
    catch-all boundaries raise it again rather than go on with every later signal ignored; once
    the run has taken it (calm), nothing is raised again."""
    from docproc.pipeline.signals import reraise_swallowed

    def like_c_code():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        except BaseException:
            raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from None

    with pytest.raises(RunInterrupted) as e:
        with signals_raise():
            try:
                like_c_code()
            except ValueError:
                reraise_swallowed()
    assert e.value.signum == signal.SIGTERM
    with signals_raise() as guard:
        try:
            like_c_code()
        except ValueError:
            guard.calm()  # (the run took it)
            reraise_swallowed()
    reraise_swallowed()  # outside a run: nothing entered


def test_signals_sent_together_end_the_run_once_and_later_ones_do_nothing():
    """SIGTERM and SIGINT arriving together (both taken in before a handler runs) raise one
    RunInterrupted, with no "ignored due to race condition" error and its traceback; a signal
    after it, once the run's guard has exited and the command's handler is back, does nothing
    (a second Ctrl-C had ended the command before the run's summary and manifest line)."""
    unraisable = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    both = {signal.SIGTERM, signal.SIGINT}
    try:
        with signals_raise() as outer:
            with pytest.raises(RunInterrupted) as e:
                with signals_raise() as run:
                    # sent to this thread while it blocks them (sent to the process, another thread
                    # of it, pytest-xdist's, would take the first at once), then both let in
                    main = threading.main_thread().ident
                    signal.pthread_sigmask(signal.SIG_BLOCK, both)
                    try:
                        signal.pthread_kill(main, signal.SIGTERM)
                        signal.pthread_kill(main, signal.SIGINT)
                    finally:
                        signal.pthread_sigmask(signal.SIG_UNBLOCK, both)
                    time.sleep(1)
            run.calm()
            for _ in range(20):  # the one the handler did not raise, run on the checks that follow
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert outer.raised is None
    finally:
        sys.unraisablehook = hook
    assert e.value.signum in both and not unraisable


def _swallowing_a_signal():
    """What pydantic's Rust validators do to an exception raised in them while typer parses the
    options: report it as unraisable and go on."""
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    except BaseException:
        pass


def test_a_signal_swallowed_before_a_run_is_raised_inside_the_run():
    """The outer guard (docproc's main) raised a signal that the code it cut into swallowed, and
    ignores signals since: the run's own guard, entered next, raises it (its manifest written)."""
    with signals_raise() as outer:
        _swallowing_a_signal()
        assert outer.raised == signal.SIGTERM
        with pytest.raises(RunInterrupted) as e:
            with signals_raise():
                t = time.time()
                while time.time() - t < 5:  # raised here, within DEFER_POLL_S
                    time.sleep(0.001)
        assert e.value.signum == signal.SIGTERM and outer.raised is None and outer.inner_entered


def test_a_signal_swallowed_while_a_command_parses_its_options_still_ends_it(tmp_path, monkeypatch, capsys):
    """Not a run (which takes the signal over): the command ends, then with the signal's code."""
    told, calls = cli.error, []

    def error(*a):  # the command's own message: a signal swallowed inside the command
        if not calls:
            _swallowing_a_signal()
        calls.append(a)
        told(*a)
    monkeypatch.setattr(cli, "error", error)
    monkeypatch.setattr(sys, "argv", ["docproc", "stats", str(tmp_path / "none")])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 143 and "stopped by SIGTERM" in capsys.readouterr().err


def test_a_signal_before_the_run_ends_the_command_with_its_code(tmp_path, monkeypatch, capsys):
    from docproc.pipeline import run as run_module

    docs = _docs(tmp_path / "in", "doc_2026_00003.jpg")

    def signalled(self, *a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the signal is raised here
        raise AssertionError("SIGTERM was not raised")
    monkeypatch.setattr(run_module.Pipeline, "__init__", signalled)
    monkeypatch.setattr(sys, "argv", ["docproc", "run", str(docs), "--out", str(tmp_path / "out")])
    handlers = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 143
    assert "stopped by SIGTERM; nothing was done" in capsys.readouterr().err
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)] == handlers


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, delay", [(signal.SIGTERM, 143, 0.2), (signal.SIGTERM, 143, 0.6),
                                              (signal.SIGTERM, 143, 1.2), (signal.SIGINT, 130, 0.4)])
def test_a_signal_while_the_model_loads_ends_the_run_with_a_manifest(one_query, tmp_path, sig, code, delay):
    """With no configuration cached the run loads the model right after taking its lock: torch and
    transformers import during the delays tried here. A signal cut into those imports crashed the
    interpreter (rc -11), or ended it with rc 70 and SystemError or 'partially initialized module'."""
    docs = _docs(tmp_path / "in", "doc_2026_00003.jpg")
    out = tmp_path / "out"
    # (a render process starts as the model loads: a signal must cut neither)
    proc = subprocess.Popen([sys.executable, "-m", "docproc", "run", str(docs), "--out", str(out), "--queries",
                             str(one_query), "--quiet", "--render-workers", "1"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lock = out / ".docproc" / "lock"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        try:
            if lock.read_text().strip() == str(proc.pid):
                break
        except OSError:
            pass
        time.sleep(0.005)
    time.sleep(delay)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "Traceback" not in err and "SystemError" not in err and "interrupted" in err
    m = _manifest(out)
    assert m["status"] == "interrupted" and m["exit_code"] == code


def test_a_run_stopped_before_its_fingerprint_is_known_does_not_load_the_model_to_write(tmp_path):
    """A first run into an empty OUT leaves its fingerprint to the engine's load; stopped before
    that (a signal, a fault), it drops the rows it holds (files settled without the engine) instead
    of loading the model in its wind-down to fingerprint them."""
    from docproc.pipeline.settings import bundled_model
    from docproc.pipeline.run import Pipeline, RunSettings

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "notes.txt").write_text("x")
    p = Pipeline(RunSettings(inputs=[str(tmp_path / "in")], out=str(tmp_path / "out"),
                             model=str(bundled_model("target"))))
    p.store.lock()
    try:
        p._part = p._first_part = p.store.next_part()
        p._pending = [("notes.txt", [{"path": "notes.txt", "config_fingerprint": None}], False)]
        assert p.cfg is None
        p._wind_down()
    finally:
        p.store.unlock()
    assert p.llm is None and p._pending == [] and not p.store.part_files()


def test_the_config_cache_key_holds_what_it_held():
    """The settings a config-cache key hashes, for the defaults: a change here moves every key, and
    every output folder's next run (a cron run with nothing to do included) loads the model once
    to recompute a fingerprint it did not need. Settings that cannot change a fingerprint are held
    at their old default (--batch-pages, the removed --fp4-value-slots) or left out."""
    from docproc.pipeline.engine_setup import keyed_settings
    from docproc.pipeline.settings import RunSettings

    assert keyed_settings(RunSettings(inputs=["x"], out="o", model="m")) == {
        "model": "m", "queries": None, "device": "auto", "kv_cache": "auto", "dpi": 120, "max_pages": None,
        "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.9, "batch_pages": 32,
        "max_image_tokens": 16384, "seed": 0, "draft": None, "spec_k": "auto", "draft_vision": "auto",
        "anchor_text": False, "enforce_eager": False, "quantization": None, "tensor_parallel_size": 1,
        "fp4_value_slots": None}
    assert keyed_settings(RunSettings(inputs=["x"], out="o", model="m", batch_pages=4, render_workers=2)) == \
        keyed_settings(RunSettings(inputs=["y"], out="p", model="m"))
    assert keyed_settings(RunSettings(inputs=["x"], out="o", model="m", batch_invariant=True))["batch_invariant"]


def test_pages_in_flight_default_follows_the_engine_device(monkeypatch, tmp_path):
    """--batch-pages: what the run holds in flight is 128 pages with a GPU, 32 on a CPU, and what
    the user gives wherever the engine runs."""
    from docproc.engine import device
    from docproc.pipeline.run import Pipeline
    from docproc.pipeline.settings import RunSettings

    def bound(gpu: bool, **kw) -> int:
        monkeypatch.setattr(device, "gpu_nodes_visible", lambda: gpu)
        return Pipeline(RunSettings(inputs=[str(tmp_path)], out=str(tmp_path / "out"), model="m", **kw)).pages_in_flight()

    assert bound(True) == 128 and bound(False) == 32
    assert bound(True, device="cpu") == 32 and bound(False, device="cuda") == 128
    assert bound(True, batch_pages=7) == bound(False, batch_pages=7) == 7


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="Linux: the kernel's VmHWM")
def test_the_peak_host_memory_is_the_runs_own_not_its_parents():
    """A run started by a process holding much memory reports its own peak: getrusage's ru_maxrss
    keeps the peak from before the exec, so started from a parent of 18 GB a run read 18 GB."""
    held = bytearray(400 << 20)
    held[:: 4096] = b"\1" * len(held[:: 4096])  # resident, not only reserved
    code = ("import resource; from docproc.engine.device import peak_host_memory; "
            "print(peak_host_memory(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    own, inherited = map(int, out.stdout.split())
    assert inherited > 400 << 20  # (what the manifest read before)
    assert own < 200 << 20
    del held

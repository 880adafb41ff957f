"""Every file, every run: hostile folders, odd names, signals and a broken environment, through the
CLI on a tiny random model (CPU). One query of two tokens keeps each run to a few seconds."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pymupdf
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from docproc.cli import app
from docproc.pipeline import ingest, runstore
from docproc.pipeline.runstore import RunStore

ROOT = Path(__file__).resolve().parent.parent
cli = CliRunner()


@pytest.fixture(scope="module")
def queries(tmp_path_factory):
    q = tmp_path_factory.mktemp("q") / "one.toml"
    q.write_text('[[query]]\nname = "total"\nquestion = "What is the total?"\nmax_tokens = 2\n')
    return q


@pytest.fixture
def run(qwen2_vl_dir, queries):
    def go(*args, model=qwen2_vl_dir, extra=()):
        argv = ["run", *[str(a) for a in args], "--model", str(model), "--device", "cpu", "--queries", str(queries),
                *extra]
        return cli.invoke(app, argv)
    return go


def page(path: Path, size=(120, 90), colour=(250, 250, 250), mode="RGB") -> Path:
    img = Image.new("RGB", size, colour)
    img.paste((20, 20, 20), (10, 10, size[0] // 2, 20))  # a dark bar: not a blank page
    if mode != "RGB":
        img = img.convert(mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


def table(out: Path) -> list[dict]:
    return pq.read_table(out / "results.parquet").to_pylist()


def by_path(out: Path) -> dict[str, dict]:
    return {r["path"]: r for r in table(out)}


def manifest(out: Path) -> dict:
    return RunStore(out).manifests()[-1]


# ---- the run goes on whatever one file is ---------------------------------------------------------
def test_odd_pages_names_and_links_each_get_one_row(run, tmp_path):
    root = tmp_path / "in"
    page(root / "wide.png", size=(2000, 8))  # aspect ratio 250: padded into the vision tower's limit
    pdf = pymupdf.open()
    pdf.new_page(width=36, height=14400).insert_text((5, 30), "tall")  # 0.5 x 200 in
    pdf.save(root / "tall.pdf")
    bad = os.fsdecode(b"r\xe4\xff.png")  # not UTF-8
    page(root / bad)
    long_name = "x" * 246 + ".png"  # 250 bytes: legal, but name + '.json' is not
    page(root / long_name)
    os.symlink("b.png", root / "a.png")
    os.symlink("a.png", root / "b.png")
    res = run(root, "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output
    rows = by_path(tmp_path / "out")
    assert rows["wide.png"]["doc_status"] == "ok" and rows["tall.pdf"]["doc_status"] == "ok"
    assert rows["r\\xe4\\xff.png"]["doc_status"] == "ok"  # the bytes kept, as escapes
    assert rows[long_name]["doc_status"] == "ok"
    assert rows["a.png"]["doc_status"] == rows["b.png"]["doc_status"] == "skipped"
    assert "loop" in rows["a.png"]["error"] and rows["a.png"]["error_kind"] == "broken_link"
    assert len(rows) == 6
    jsons = sorted(p.name for p in (tmp_path / "out" / "json").iterdir())
    assert len(jsons) == 6 and all(len(n.encode()) <= 255 for n in jsons)
    assert "wide.png.json" in jsons and sum("~" in n for n in jsons) == 2  # escaped and too long: hashed
    doc = json.loads((tmp_path / "out" / "json" / runstore.json_relpath("r\\xe4\\xff.png")).read_text())
    assert doc["path"] == "r\\xe4\\xff.png"


def test_hostile_names_roots_and_state(run, tmp_path):
    """Names one byte apart from an escape, a root whose own path is not UTF-8, Rich markup in
    OUT, a strip that would pad to 200 Mpx, a stray file among the parts."""
    root = tmp_path / os.fsdecode(b"in\xff")
    page(root / os.fsdecode(b"r\xe4.png"))
    page(root / "r\\xe4.png", colour=(90, 90, 90))  # a backslash, x, e, 4: another file, another key
    Image.new("L", (1, 200_000), 255).save(root / "strip.png")
    out = tmp_path / "out[/x]"
    res = run(root, "--out", out)
    assert res.exit_code == 0, res.output
    rows = by_path(out)
    assert sorted(rows) == ["r\\\\xe4.png", "r\\xe4.png", "strip.png"]
    assert rows["strip.png"]["doc_status"] == "ok"
    assert all(r["root"].endswith("in\\xff") for r in rows.values())
    (RunStore(out).parts_dir / "part-zz.rows").write_text("not a part")
    assert run(root, "--out", out).exit_code == 0 and manifest(out)["totals"]["already_done"] == 3


def test_padding_is_bounded_and_answers_never_raise():
    from docproc.multimodal import MAX_PADDED_PIXELS, fit_aspect, padded_size
    from docproc.pipeline.queries import parse_answer

    assert padded_size(2000, 8) == (2000, 10) and padded_size(8, 2000) == (10, 2000)
    assert padded_size(300, 200) == (300, 200)
    w, h = padded_size(1, 1_000_000)
    assert w * h <= MAX_PADDED_PIXELS and h / w <= 200
    assert fit_aspect(Image.new("RGB", (1, 1_000_000))).size == (w, h)
    assert parse_answer("number", "1" * 40) == (None, "not a number: '" + "1" * 40 + "'")
    assert parse_answer("json", "{" * 100_000 + "}" * 100_000)[0] is None


def test_a_pdf_removed_after_it_was_found_is_unreadable_not_damaged(tmp_path):
    import pymupdf

    pdf = pymupdf.open()
    pdf.new_page()
    pdf.save(tmp_path / "gone.pdf")
    c, = ingest.discover([tmp_path])
    digest = ingest.file_digest(c)
    (tmp_path / "gone.pdf").unlink()  # between the triage's hash and the render
    with pytest.raises(ingest.DocumentError) as e:
        ingest.open_document(c, digest=digest)
    assert e.value.kind == "unreadable" and "cannot read file: No such file" in str(e.value)


def test_pixels_as_a_person_sees_them(tmp_path):
    rgba = Image.new("RGBA", (40, 30), (0, 0, 0, 0))  # transparent black: a white page with nothing on it
    rgba.paste((200, 0, 0, 255), (0, 0, 10, 10))
    rgba.save(tmp_path / "alpha.png")
    grey16 = Image.fromarray((np.ones((30, 40)) * 32896).astype(np.uint16))  # mid grey in 16 bits
    grey16.save(tmp_path / "grey16.png")
    Image.new("CMYK", (40, 30), (0, 0, 0, 0)).save(tmp_path / "cmyk.jpg")  # no ink: white
    pal = Image.new("P", (40, 30), 0)
    pal.putpalette([0, 0, 0, 255, 255, 255] + [0] * 762)
    pal.save(tmp_path / "palette.png", transparency=0)  # colour 0 (black) transparent
    rotated = Image.new("RGB", (40, 30), "white")
    rotated.paste((0, 0, 0), (0, 0, 5, 5))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to view
    rotated.save(tmp_path / "exif.jpg", exif=exif, quality=95)
    keyed = Image.new("RGB", (40, 30), (0, 0, 0))
    keyed.paste((0, 0, 255), (0, 0, 10, 10))
    keyed.save(tmp_path / "keyed.png", transparency=(0, 0, 0))  # RGB with a transparent colour
    got = {}
    for c in ingest.discover([tmp_path]):
        doc = ingest.open_document(c)
        got[c.rel] = doc.page(0).image
        doc.close()
    assert got["alpha.png"].getpixel((30, 20)) == (255, 255, 255) and got["alpha.png"].getpixel((2, 2)) == (200, 0, 0)
    assert got["grey16.png"].getpixel((5, 5)) == (128, 128, 128)
    assert min(got["cmyk.jpg"].getpixel((5, 5))) >= 250
    assert got["palette.png"].getpixel((5, 5)) == (255, 255, 255)
    assert got["exif.jpg"].size == (30, 40)  # turned upright
    assert got["keyed.png"].getpixel((30, 20)) == (255, 255, 255) and got["keyed.png"].getpixel((2, 2)) == (0, 0, 255)
    assert all(im.mode == "RGB" for im in got.values())


@pytest.mark.slow
def test_keys_are_unique_and_files_count_once(run, tmp_path, monkeypatch):
    page(tmp_path / "x" / "inv.png", colour=(240, 240, 240))
    page(tmp_path / "y" / "inv.png", colour=(230, 230, 230))
    res = run(tmp_path / "x" / "inv.png", tmp_path / "y" / "inv.png", "--out", tmp_path / "o1")
    assert res.exit_code == 0, res.output
    keys = sorted(by_path(tmp_path / "o1"))
    assert len(keys) == 2 and keys[0].endswith("x/inv.png") and keys[1].endswith("y/inv.png")
    assert len(list((tmp_path / "o1" / "json").rglob("*.json"))) == 2

    monkeypatch.chdir(tmp_path)  # folders given as typed: keys behind each root's name
    res = run("x", "./y/", "--out", tmp_path / "o2")
    assert res.exit_code == 0 and sorted(by_path(tmp_path / "o2")) == ["x/inv.png", "y/inv.png"]

    os.symlink(tmp_path / "x" / "inv.png", tmp_path / "x" / "a_link.png")  # the same file, by a link
    os.link(tmp_path / "x" / "inv.png", tmp_path / "x" / "hard.png")  # and by a second name
    res = run("x", "x", "--out", tmp_path / "o3")
    assert res.exit_code == 0, res.output
    m = manifest(tmp_path / "o3")
    # one file, under its first real name in sorted order (a link's name only if no real one)
    assert m["totals"]["files"] == 1 and sorted(by_path(tmp_path / "o3")) == ["hard.png"]


def test_output_inside_the_input_is_never_read(run, tmp_path):
    root = tmp_path / "in"
    page(root / "a.png")
    for _ in range(2):
        res = run(root, "--out", root / "out")
        assert res.exit_code == 0, res.output
    assert sorted(by_path(root / "out")) == ["a.png"]
    assert not (root / "out" / "json" / "out").exists()
    res = run(root, "--out", root)
    assert res.exit_code == 2 and "also an input" in res.output
    res = run(root / "out" / "json", "--out", root / "out")
    assert res.exit_code == 2 and "inside the output folder" in res.output


@pytest.mark.slow
def test_the_folder_is_the_truth_removed_and_renamed_files(run, tmp_path):
    root = tmp_path / "in"
    page(root / "a.png", colour=(240, 240, 240))
    page(root / "b.png", colour=(220, 220, 220))
    page(root / "c.png", colour=(200, 200, 200))
    out = tmp_path / "out"
    assert run(root, "--out", out).exit_code == 0
    before = by_path(out)
    (root / "a.png").unlink()
    (root / "b.png").rename(root / "b_renamed.png")
    res = run(root, "--out", out)
    assert res.exit_code == 0, res.output
    m = manifest(out)
    assert m["totals"]["removed"] == 1 and m["totals"]["moved"] == 1 and m["totals"]["already_done"] == 1
    assert m["totals"]["requests"] == 0  # the renamed file's rows moved: the model did not run
    after = by_path(out)
    assert sorted(after) == ["b_renamed.png", "c.png"]
    assert after["b_renamed.png"]["answer"] == before["b.png"]["answer"]
    assert after["b_renamed.png"]["doc_sha256"] == before["b.png"]["doc_sha256"]
    assert sorted(p.name for p in (out / "json").iterdir()) == ["b_renamed.png.json", "c.png.json"]
    # another root's rows in the same folder are not "removed" by a run over this one
    page(tmp_path / "other" / "z.png")
    assert run(tmp_path / "other", "--out", out).exit_code == 0
    assert sorted(by_path(out)) == ["b_renamed.png", "c.png", "z.png"]
    # a root with no files left at all (an unmounted share?) keeps its rows, said out loud; with
    # one file left the others are removed; json-only runs keep results.parquet current
    page(tmp_path / "other" / "y.png", colour=(70, 70, 70))
    assert run(tmp_path / "other", "--out", out).exit_code == 0
    (tmp_path / "other" / "z.png").unlink()
    (tmp_path / "other" / "y.png").rename(tmp_path / "y.png")
    res = run(tmp_path / "other", "--out", out, extra=["--format", "json"])
    assert res.exit_code == 0 and "holds no files now" in res.output
    assert manifest(out)["totals"]["removed"] == 0 and "z.png" in by_path(out)
    (tmp_path / "y.png").rename(tmp_path / "other" / "y.png")
    assert run(tmp_path / "other", "--out", out, extra=["--format", "json"]).exit_code == 0
    assert manifest(out)["totals"]["removed"] == 1
    assert sorted(by_path(out)) == ["b_renamed.png", "c.png", "y.png"]  # results.parquet kept current with json only
    page(tmp_path / "third" / "c.png", colour=(10, 10, 10))
    res = run(tmp_path / "third", "--out", out)  # the same path from another root: said, not silent
    assert res.exit_code == 0 and "from another input root" in res.output
    assert by_path(out)["c.png"]["root"] == str((tmp_path / "third").resolve())


def test_outputs_follow_the_umask_and_readers_see_each_row_once(run, tmp_path):
    root = tmp_path / "in"
    page(root / "a.png")
    page(root / "b.png", colour=(100, 100, 100))
    old = os.umask(0o002)
    try:
        assert run(root, "--out", tmp_path / "out").exit_code == 0
    finally:
        os.umask(old)
    out = tmp_path / "out"
    for f in [out / "results.parquet", *out.rglob("*.json"), *out.rglob("*.rows")]:
        assert f.stat().st_mode & 0o777 == 0o664, f
    found = sorted(str(p.relative_to(out)) for p in out.glob("**/*.parquet"))  # DuckDB-style glob
    assert found == ["results.parquet"]
    ds = pads.dataset(str(out), format="parquet", exclude_invalid_files=True)
    assert ds.to_table().num_rows == len(table(out)) == 2


# ---- clear errors -------------------------------------------------------------------------------------
def test_usage_errors_before_the_model_loads(run, tmp_path):
    t0 = time.perf_counter()
    res = run(tmp_path / "typo", "--out", tmp_path / "out")
    assert res.exit_code == 2 and "does not exist" in res.output and not (tmp_path / "out").exists()
    assert time.perf_counter() - t0 < 30  # no model was loaded (it takes longer than discovery, not a timing test)
    page(tmp_path / "a.png")
    # an empty path (`docproc run "$INBOX"` with the variable unset) is not the current folder
    for args in (["", "--out", tmp_path / "out"], [tmp_path / "a.png", "--out", ""],
                 [tmp_path / "a.png", "--out", tmp_path / "out", "--queries", ""], ["stats", ""]):
        res = cli.invoke(app, ([] if args[0] == "stats" else ["run"]) + [str(a) for a in args])
        assert res.exit_code == 2 and "an empty path" in res.output and not (tmp_path / "out").exists(), args
    (tmp_path / "l1").symlink_to(tmp_path / "l2")
    (tmp_path / "l2").symlink_to(tmp_path / "l1")
    (tmp_path / "gone").symlink_to(tmp_path / "nothing")
    for args, want in (([tmp_path / "l1", "--out", tmp_path / "out"], "is (or passes through) a symbolic link loop"),
                       ([tmp_path / "l1" / "x.png", "--out", tmp_path / "out"], "passes through) a symbolic link loop"),
                       ([tmp_path / "gone", "--out", tmp_path / "out"], "is a broken symbolic link"),
                       (["stats", tmp_path / "typo"], f"{tmp_path / 'typo'} does not exist"),
                       (["stats", tmp_path / "a.png"], "is not a folder"),
                       (["eval", tmp_path / "a.png", "--truth", tmp_path / "a.png"], "is not a folder")):
        res = cli.invoke(app, ([] if args[0] in ("stats", "eval") else ["run"]) + [str(a) for a in args])
        assert res.exit_code == 2 and want in res.output and not (tmp_path / "out").exists(), (args, res.output)
    cases = {
        'max_tokens = "many"': "whole number",
        "max_tokens = 2.7": "whole number",
        "max_tokens = 0": "from 1 to",
        "question = { a = 1 }": "non-empty string",
        'colour = "red"': "unknown key",
    }
    for line, want in cases.items():
        q = tmp_path / "q.toml"
        body = '[[query]]\nname = "total"\n' + ("" if line.startswith("question") else 'question = "Total?"\n')
        q.write_text(body + line + "\n")
        res = cli.invoke(app, ["run", str(tmp_path / "a.png"), "--out", str(tmp_path / "o"), "--queries", str(q)])
        assert res.exit_code == 2 and want in res.output, (line, res.output)
    res = cli.invoke(app, ["run", str(tmp_path / "a.png"), "--out", str(tmp_path / "o"), "--queries", str(tmp_path)])
    assert res.exit_code == 2 and "is a folder" in res.output
    # read up to a limit: /dev/zero (read whole, it took all memory) and a file far too big
    (tmp_path / "big.toml").write_bytes(b"#" * (17 << 20))
    for odd in ("/dev/zero", str(tmp_path / "big.toml")):
        res = cli.invoke(app, ["run", str(tmp_path / "a.png"), "--out", str(tmp_path / "o"), "--queries", odd])
        assert res.exit_code == 2 and "is over 16 MiB" in res.output, res.output
    (tmp_path / "empty.toml").write_text('name = "x"\n')
    res = cli.invoke(app, ["run", str(tmp_path / "a.png"), "--out", str(tmp_path / "o"), "--queries",
                           str(tmp_path / "empty.toml")])
    assert res.exit_code == 2 and "[[query]]" in res.output  # shown as written, not eaten as markup
    for flag in (["--batch-pages", "0"], ["--device", "tpu"], ["--gpu-memory-utilization", "1.5"], ["--dpi", "5"]):
        res = cli.invoke(app, ["run", str(tmp_path / "a.png"), "--out", str(tmp_path / "o"), *flag])
        assert res.exit_code == 2, flag
    assert not (tmp_path / "o").exists()


def test_environment_faults_stop_with_one_line_and_their_exit_code(run, tmp_path, monkeypatch):
    page(tmp_path / "in" / "a.png")
    (tmp_path / "file").write_text("not a folder")
    res = run(tmp_path / "in", "--out", tmp_path / "file")
    assert res.exit_code == 5 and "a file stands where a folder is needed" in res.output
    assert "Traceback" not in res.output

    res = run(tmp_path / "in", "--out", tmp_path / "o_draft", extra=["--draft", str(tmp_path / "missing")])
    assert res.exit_code == 3 and "does not exist" in res.output and "repo" not in res.output.lower()
    assert manifest(tmp_path / "o_draft")["status"] == "failed"
    res = run(tmp_path / "in", "--out", tmp_path / "o_model", model=tmp_path / "nomodel")
    assert res.exit_code == 3 and manifest(tmp_path / "o_model")["fault"]["kind"] == "model"

    if not torch.cuda.is_available():
        res = cli.invoke(app, ["run", str(tmp_path / "in"), "--out", str(tmp_path / "o_cuda"), "--device", "cuda"])
        assert res.exit_code == 4 and "no CUDA device" in res.output and "Traceback" not in res.output

    real_mkstemp = runstore.tempfile.mkstemp

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(runstore.tempfile, "mkstemp", read_only)
    res = run(tmp_path / "in", "--out", tmp_path / "o_ro")
    assert res.exit_code == 5 and "read-only" in res.output
    monkeypatch.setattr(runstore.tempfile, "mkstemp", real_mkstemp)
    # `ulimit -f` (EFBIG): said as such, with the fix (it was "File too large", naming the folder)
    message = str(runstore.output_fault(OSError(errno.EFBIG, "File too large"), tmp_path / "o"))
    assert "file size limit (`ulimit -f`)" in message and "raise the limit" in message


def test_a_damaged_part_is_said_set_aside_and_its_documents_redone(run, tmp_path):
    root = tmp_path / "in"
    page(root / "a.png")
    out = tmp_path / "out"
    assert run(root, "--out", out).exit_code == 0
    part, = (out / ".docproc" / "parts").glob("*.rows")
    part.write_bytes(part.read_bytes()[:40])  # damaged since it was written
    # tables under a part's name that are not ours: other columns (ours read as nulls), a type
    # ours cannot be cast from (these crashed stats, eval and run with a TypeError)
    foreign = [part.with_name(f"part-9000000{i}.rows") for i in range(4)]
    pq.write_table(pyarrow.table({"a": [1, 2]}), foreign[0])
    pq.write_table(pyarrow.table({"path": [{"x": 1}], "part": [7]}), foreign[1])
    pq.write_table(pyarrow.table([pyarrow.array(["x"]), pyarrow.array(["y"])], names=["path", "path"]), foreign[2])
    os.mkfifo(foreign[3])  # (read, it would hold every reader forever)
    assert cli.invoke(app, ["stats", str(out)]).exit_code == 0
    res = run(root, "--out", out)
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    for f in (part, *foreign):
        assert f"{f.name} is damaged or is not one of docproc's tables" in said
        assert (f.parent / (f.name + ".damaged")).exists()  # set aside, not deleted
    m = manifest(out)
    assert m["totals"]["already_done"] == 0 and m["totals"]["ok"] + m["totals"]["partial"] == 1  # redone
    assert sorted(by_path(out)) == ["a.png"]


def test_a_part_that_cannot_be_read_now_is_said_and_kept_and_its_documents_redone(run, tmp_path, monkeypatch):
    """A part the system refuses to read (a permission, an I/O error) holds rows no table read
    has: the run says so and redoes its documents, and nothing is compacted while it cannot be
    read (the part was deleted with the others); read again later, its rows are older than the
    redone ones and a removal made meanwhile."""
    root = tmp_path / "in"
    page(root / "a.png")
    page(root / "b.png", colour=(10, 200, 10))
    out = tmp_path / "out"
    assert run(root, "--out", out).exit_code == 0
    page(root / "c.png", colour=(10, 10, 200))
    assert run(root, "--out", out).exit_code == 0  # a second part
    parts = RunStore(out).part_files()
    assert len(parts) == 1  # (compacted)
    held = parts[0]
    real = runstore.read_table

    def refused(path, schema=None):
        if Path(path) == held:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, schema)
    monkeypatch.setattr(runstore, "read_table", refused)
    res = run(root, "--out", out)
    assert res.exit_code == 0, res.output
    assert f"{held.name} cannot be read now: the documents only it recorded are redone" in " ".join(res.output.split())
    assert manifest(out)["totals"]["already_done"] == 0  # redone
    assert held.exists() and len(RunStore(out).part_files()) == 2  # kept, nothing compacted
    (root / "b.png").unlink()  # removed while the part still cannot be read
    assert run(root, "--out", out).exit_code == 0 and held.exists()
    monkeypatch.setattr(runstore, "read_table", real)
    current = RunStore(out).current().column("path").to_pylist()
    assert sorted(set(current)) == ["a.png", "c.png"]  # (its rows older than the redone ones and the removal)
    res = run(root, "--out", out)  # readable again: folded in
    assert res.exit_code == 0 and manifest(out)["totals"]["already_done"] == 2
    assert not held.exists() and len(RunStore(out).part_files()) == 1
    assert sorted(by_path(out)) == ["a.png", "c.png"]


def test_a_full_disk_during_a_redo_keeps_the_recorded_documents_json(run, tmp_path, monkeypatch):
    root = tmp_path / "in"
    page(root / "a.png")
    out = tmp_path / "out"
    assert run(root, "--out", out).exit_code == 0

    def full(self, part, rows):
        raise runstore.output_fault(OSError(errno.ENOSPC, "No space left on device"), self.out)
    monkeypatch.setattr(runstore.RunStore, "write_part", full)
    assert run(root, "--out", out, extra=["--force"]).exit_code == 5
    assert (out / "json" / "a.png.json").exists()  # its rows are recorded: its file stays


@pytest.mark.slow
def test_a_full_disk_stops_the_run_and_the_next_run_finishes(run, tmp_path, monkeypatch):
    root = tmp_path / "in"
    for i in range(4):
        page(root / f"p{i}.png", colour=(200 + 10 * i,) * 3)
    out = tmp_path / "out"
    real = runstore.RunStore.write_part
    calls = []

    def fills_up(self, part, rows):
        calls.append(part)
        if len(calls) > 1:
            raise runstore.output_fault(OSError(errno.ENOSPC, "No space left on device"), self.out)
        return real(self, part, rows)

    monkeypatch.setattr(runstore.RunStore, "write_part", fills_up)
    res = run(root, "--out", out, extra=["--batch-pages", "1"])
    assert res.exit_code == 5 and "no space left" in res.output and "Traceback" not in res.output
    m = manifest(out)
    assert m["status"] == "failed" and m["fault"]["kind"] == "output" and m["fault"]["documents_kept"] == 1
    assert "the 1 document(s) finished before it are kept" in " ".join(res.output.split())
    # the document whose part failed leaves no JSON file without rows
    assert len(list((out / "json").iterdir())) == 1
    monkeypatch.setattr(runstore.RunStore, "write_part", real)
    res = run(root, "--out", out)
    assert res.exit_code == 0, res.output
    assert manifest(out)["totals"]["already_done"] == 1  # the document flushed before the disk filled up
    rows = table(out)
    assert sorted(r["path"] for r in rows) == [f"p{i}.png" for i in range(4)]


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
@pytest.mark.slow
def test_signals_end_the_run_with_a_manifest(qwen2_vl_dir, queries, tmp_path, sig, code):
    root = tmp_path / "in"
    for i in range(12):
        page(root / f"p{i:02d}.png", colour=(100 + 10 * i,) * 3)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "docproc", "run", str(root), "--out", str(out), "--model", str(qwen2_vl_dir),
           "--device", "cpu", "--quiet", "--batch-pages", "1", "--queries", str(queries)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not list((out / ".docproc" / "parts").glob("*.rows")
                                                                      if (out / ".docproc" / "parts").is_dir() else []):
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "Traceback" not in err and "interrupted" in err
    m = manifest(out)
    assert m["status"] == "interrupted" and m["exit_code"] == code
    # the engine's stage until the signal is recorded (it was left out of the timeline, and the
    # step the signal ended out of the seconds)
    start, end = m["stage_timeline"]["engine"]
    assert m["stage_seconds"]["engine"] > 0 and start <= end
    holder = RunStore(out)
    holder.lock()  # the lock was freed
    holder.unlock()
    done = m["totals"]["documents"]
    assert 1 <= done < 12 and len(table(out)) == done
    res = cli.invoke(app, ["run", str(root), "--out", str(out), "--model", str(qwen2_vl_dir), "--device", "cpu",
                           "--queries", str(queries)])
    assert res.exit_code == 0 and len(table(out)) == 12


def test_failed_files_are_named_and_listed(run, tmp_path):
    root = tmp_path / "in"
    page(root / "good.png")
    (root / "damaged.pdf").write_bytes(b"%PDF-1.4\n" + os.urandom(2000))
    Image.new("1", (9000, 9000)).save(root / "bomb.png")  # 81 Mpx: over the 40 Mpx cap
    for i in range(6):
        (root / f"junk{i}.jpg").write_bytes(b"not a jpeg")
    res = run(root, "--out", tmp_path / "out")
    assert res.exit_code == 1
    rows = by_path(tmp_path / "out")
    assert rows["damaged.pdf"]["error"] == "not a readable PDF: the file is damaged or is not a PDF"
    assert "40 Mpx cap" in rows["bomb.png"]["error"] and rows["bomb.png"]["error_kind"] == "too_large"
    assert "failed 8 file(s)" in res.output and "and 3 more" in res.output and "--failures" in res.output
    listed = cli.invoke(app, ["stats", str(tmp_path / "out"), "--failures", "--json"])
    data = json.loads(listed.output)
    assert len(data) == 8 and {d["path"] for d in data} == set(rows) - {"good.png"}
    assert all(d["error"] and d["kind"] for d in data)
    human = cli.invoke(app, ["stats", str(tmp_path / "out"), "--failures"])
    assert human.exit_code == 0 and "damaged.pdf" in human.output


# ---- one document's unexpected exception, at every stage ---------------------------------------------
STAGES = ["discovery", "open", "render", "hash", "preprocessing", "encode", "answers", "write"]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.slow
def test_an_unexpected_exception_fails_only_its_document(run, qwen2_vl_dir, tmp_path, monkeypatch, stage):
    from docproc.models import processor as processor_mod
    from docproc.models.loader import read_config
    from docproc.models.vision import VisionEncoder
    from docproc.pipeline import rows as rows_mod
    from docproc.pipeline import run as run_mod

    bad_size = (60, 200)  # the document that raises is told by its page size (and its patch grid)
    bad_grid = list(processor_mod.Processor(qwen2_vl_dir, read_config(qwen2_vl_dir)).grid_thw(Image.new("RGB", bad_size)))
    root = tmp_path / "in"
    page(root / "a.png", colour=(250, 250, 250))
    page(root / "bad.png", size=bad_size, colour=(240, 240, 240))
    page(root / "c.png", colour=(230, 230, 230))

    def raise_for_bad(fn, test):
        def wrapped(*a, **k):
            if test(*a, **k):
                raise RuntimeError("injected")
            return fn(*a, **k)
        return wrapped

    targets = {
        "discovery": (ingest, "_classify", lambda p, *a, **k: Path(p).name == "bad.png"),
        "open": (ingest, "_open_image", lambda c, *a, **k: c.path.name == "bad.png"),
        "render": (ingest, "to_rgb", lambda im: im.size == bad_size),
        "hash": (ingest, "_sha256_file", lambda p: Path(p).name == "bad.png"),
        "preprocessing": (processor_mod.Processor, "pixel_values",
                          lambda self, images: any(i.size == bad_size for i in images)),
        "encode": (VisionEncoder, "encode", lambda self, pixels, grids: bad_grid in grids.tolist()),
        "answers": (run_mod.Pipeline, "_answers", lambda self, w, outs: w.doc.doc.candidate.rel == "bad.png"),
        "write": (rows_mod, "document_json", lambda rows: rows[0]["path"] == "bad.png"),
    }
    owner, name, test = targets[stage]
    monkeypatch.setattr(owner, name, raise_for_bad(getattr(owner, name), test))
    out = tmp_path / "out"
    # (rendering on a thread of this process: the patches above reach it)
    res = run(root, "--out", out, extra=["--batch-pages", "8", "--render-workers", "0"])
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    rows = by_path(out)
    assert sorted(rows) == ["a.png", "bad.png", "c.png"]
    assert rows["bad.png"]["doc_status"] == "error" and "injected" in rows["bad.png"]["error"]
    assert rows["bad.png"]["error_kind"] == "internal"
    assert rows["a.png"]["doc_status"] == rows["c.png"]["doc_status"] == "ok"
    m = manifest(out)
    assert m["totals"]["errors"] == 1 and m["totals"]["ok"] == 2
    # each good document's request ran once: no second engine run, no doubled figures
    if stage not in ("discovery", "open", "render", "hash"):
        assert m["totals"]["requests"] in (2, 3)
        assert rows["a.png"]["prompt_tokens"] == rows["c.png"]["prompt_tokens"]
    # the next run tries the document again (an internal error says nothing about its bytes)
    monkeypatch.undo()
    res = run(root, "--out", out)
    assert res.exit_code == 0 and by_path(out)["bad.png"]["doc_status"] == "ok"
    assert manifest(out)["totals"]["already_done"] == 2


@pytest.mark.slow
def test_the_same_file_under_another_key_and_the_older_layout(run, tmp_path):
    """A file of a processed folder given alone keeps one set of rows (no second model run, no
    warning); skipped files are not rewritten by every run; an output folder of the older layout
    (parts in OUT/parts, rows without roots) is read by stats before any run, and its deleted
    documents leave results.parquet once a run adopts it; a parquet-only run leaves no stale JSON."""
    root = tmp_path / "in"
    page(root / "one.png")
    page(root / "sub" / "two.png", colour=(90, 90, 90))
    (root / "notes.txt").write_text("not a document")
    out = tmp_path / "out"
    assert run(root, "--out", out).exit_code == 0
    res = run(root / "one.png", "--out", out)
    assert res.exit_code == 0 and "another input root" not in res.output
    assert manifest(out)["totals"]["requests"] == 0  # the same file: already done
    res = run(root / "sub" / "two.png", "--out", out)
    assert res.exit_code == 0 and manifest(out)["totals"]["requests"] == 0
    keys = sorted(by_path(out))
    assert keys == ["notes.txt", "one.png", "two.png"]  # sub/two.png moved to its new key, not doubled
    before = {r["path"]: r["run_id"] for r in table(out)}
    assert run(root, "--out", out).exit_code == 0
    assert {r["path"]: r["run_id"] for r in table(out)}["notes.txt"] == before["notes.txt"]  # not rewritten

    # the older layout: parts in OUT/parts, no roots recorded
    old = tmp_path / "old"
    assert run(root, "--out", old).exit_code == 0
    store = RunStore(old)
    rows = table(old)
    for r in rows:
        r["root"] = None
    (old / "parts").mkdir()
    runstore.atomic_write_table(old / "parts" / "part-00000001.parquet", runstore.to_table(rows))
    for f in store.parts_dir.iterdir():
        f.unlink()
    (root / "notes.txt").unlink()
    (root / "bad.jpg").write_bytes(b"not a jpeg")
    listed = json.loads(cli.invoke(app, ["stats", str(old), "--failures", "--json"]).output)
    assert listed == []  # read before any run moved the parts (no failures in them)
    assert run(root, "--out", old, extra=["--format", "parquet"]).exit_code == 1
    assert "notes.txt" not in by_path(old) and by_path(old)["bad.jpg"]["doc_status"] == "error"
    assert not (old / "parts").exists() and not (old / "json" / "notes.txt.json").exists()
    assert not (old / "json" / "bad.jpg.json").exists()  # parquet only: no JSON, none left stale


@pytest.mark.slow
def test_a_reader_that_goes_away_stops_nothing(qwen2_vl_dir, queries, tmp_path):
    """`docproc run ... --log-json | head -1`: the run finishes, with its manifest and exit code."""
    root = tmp_path / "in"
    for i in range(3):
        page(root / f"p{i}.png", colour=(100 + 40 * i,) * 3)
    out = tmp_path / "out"
    for extra in (["--log-json"], []):
        proc = subprocess.Popen([sys.executable, "-m", "docproc", "run", str(root), "--out", str(out), "--model",
                                 str(qwen2_vl_dir), "--device", "cpu", "--queries", str(queries), "--force", *extra],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.close()  # the reader is gone before the first line
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=300) == 0, err
        assert "Traceback" not in err and manifest(out)["status"] == "completed"
        assert len(table(out)) == 3


@pytest.mark.slow
def test_reading_results_leaves_a_process_that_exits_cleanly(tmp_path):
    """stats, eval and the run read OUT's Parquet through a Python file; with pyarrow's thread
    pool such a read aborted the interpreter at exit in most processes (SIGABRT, "terminate called
    without an active exception"), so `docproc eval` failed a caller that checks its exit code."""
    from docproc.pipeline.schema import RESULT_SCHEMA, read_table, to_table

    path = tmp_path / "results.parquet"
    rows = [{"run_id": "r", "path": f"d{i}.pdf", "doc_status": "ok", "query": "total", "status": "ok",
             "value": str(i), "config_fingerprint": "c", "part": i} for i in range(500)]
    pq.write_table(to_table(rows), path, row_group_size=50)
    script = ("import sys; from docproc.pipeline.schema import read_table; "
              "t = read_table(sys.argv[1]); assert t.num_rows == 500, t.num_rows")
    codes = [subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True).returncode
             for _ in range(8)]
    assert codes == [0] * 8
    assert read_table(path, schema=RESULT_SCHEMA).column("value").to_pylist()[-1] == "499"

"""What `docproc` tells its user: help that reads like a command line's, --version, one line for a
run that cannot start (exit 2, 3 or 4, nothing left behind but the manifest), a warning for the
GPU-only options on a CPU, and the tokenizer files a model folder needs."""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from rich.console import Console
from typer.testing import CliRunner

from docproc import cli
from docproc.cli import app

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "docproc" / "assets" / "models" / "target"


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture
def docs(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    Image.new("RGB", (64, 48), (255, 255, 255)).save(folder / "blank.png")  # answered without the engine
    return folder


def model_files(dst: Path, *names: str) -> Path:
    """A model folder with only these files of the bundled target (no weights: the folder checks
    come before any load)."""
    dst.mkdir()
    for name in names:
        shutil.copy(TARGET / name, dst / name)
    return dst


def test_run_help_shows_its_text_as_written_with_plain_metavars():
    res = CliRunner().invoke(app, ["run", "--help"])
    assert res.exit_code == 0
    assert "'docproc[ray]'" in res.output  # Rich markup had eaten "[ray]"
    usage = res.output.splitlines()[0]
    assert usage.endswith("run [OPTIONS] INPUTS..."), usage
    assert "--model DIR" in res.output and "--spec-k K" in res.output and "-o, --out DIR" in res.output
    for typer_type in ("<bool>", "<str>", "<int>", "<path>", "{inputs}", "list[Path]"):
        assert typer_type not in res.output, typer_type


def test_every_option_names_its_flag_and_metavar():
    """Options written with their flag names: typer 0.27 derives a name from the metavar where
    none is given (`--DEVICE`), so a user there could not pass --device, --model or --queries."""
    import ast
    import inspect

    import docproc.cli as cli

    for node in ast.walk(ast.parse(inspect.getsource(cli))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "Option":
            flags = [a.value for a in node.args[1:] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            assert any(f.startswith("--") for f in flags), ast.unparse(node)[:80]
    for command in ("eval", "stats"):
        res = CliRunner().invoke(app, [command, "--help"])
        assert res.output.splitlines()[0].endswith(f"{command} [OPTIONS] OUT"), res.output
    assert "<int>" not in res.output and "--limit N" in res.output  # (stats')


def test_version_prints_the_version_without_importing_torch():
    from docproc import __version__

    code = ("import sys\nfrom typer.testing import CliRunner\nfrom docproc.cli import app\n"
            "res = CliRunner().invoke(app, ['--version'])\n"
            "print(repr((res.output, res.exit_code, 'torch' in sys.modules)))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == repr((f"docproc {__version__}\n", 0, False))


def assert_stopped_in_one_line(res, out: Path, code: int, *words: str) -> None:
    """Exit `code`, one line on stderr holding `words`, nothing on stdout (no summary), and in OUT
    a failed manifest but no results.parquet."""
    assert res.exit_code == code, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert res.stdout == ""
    assert not (out / "results.parquet").exists()
    manifests = list(out.glob("runs/*/manifest.json"))
    assert len(manifests) == 1 and json.loads(manifests[0].read_text())["status"] == "failed"


@pytest.mark.parametrize("flag", ["--model", "--draft"])
def test_a_model_folder_without_tokenizer_files_is_one_line_and_exit_3(docs, tmp_path, flag):
    folder = model_files(tmp_path / "no_tokenizer", "config.json", "tokenizer_config.json",
                         "preprocessor_config.json")
    out = tmp_path / "out"
    res = invoke("run", docs, "--out", out, flag, folder, "--device", "cpu")
    what = "model" if flag == "--model" else "draft"
    assert_stopped_in_one_line(res, out, 3, f"{what} folder {folder} has no tokenizer.json", "copy the tokenizer")


def test_a_missing_device_is_one_line_and_exit_4(docs, tmp_path):
    out = tmp_path / "out"
    res = invoke("run", docs, "--out", out, "--device", "cuda:63")  # no machine has 64 GPUs
    assert_stopped_in_one_line(res, out, 4, "cuda:63")


@pytest.mark.parametrize("option,value", [("--spec-k", "3"), ("--draft-vision", "own")])
def test_draft_options_without_a_draft_are_a_usage_error(docs, tmp_path, option, value):
    res = invoke("run", docs, "--out", tmp_path / "out", option, value, "--model", tmp_path / "none")
    assert res.exit_code == 2, res.output
    assert f"{option} goes with --draft" in res.stderr
    assert not (tmp_path / "out").exists()


def test_the_removed_fp4_value_slots_option_takes_the_default_with_a_warning_and_refuses_slots(docs, tmp_path):
    """FP4 values have no outlier slots: a command line that spelled out the default still runs (a
    warning says to drop it); one that asks for slots is a usage error saying why."""
    res = invoke("run", docs, "--out", tmp_path / "out", "--fp4-value-slots", "2")
    assert res.exit_code == 2 and "no outlier slots" in res.stderr, res.output
    assert not (tmp_path / "out").exists()
    res = invoke("run", docs, "--out", tmp_path / "out", "--fp4-value-slots", "0", "--dry-run")
    assert res.exit_code == 0 and "--fp4-value-slots 0 is what every FP4 run does" in res.stderr, res.output


def test_the_summary_shows_a_dash_for_figures_of_a_model_not_loaded(monkeypatch, docs, tmp_path):
    out = tmp_path / "out"
    assert invoke("run", docs, "--out", out, "--device", "cuda:63").exit_code == 4
    manifest = json.loads(next(out.glob("runs/*/manifest.json")).read_text())
    assert manifest["dedup"]["vision_encodes"] is None
    buf = io.StringIO()
    monkeypatch.setattr(cli, "out_console", Console(file=buf, width=200))
    cli._summary(manifest)
    assert "vision encodes -)" in buf.getvalue() and "None" not in buf.getvalue(), buf.getvalue()


def test_gpu_only_options_on_a_cpu_get_one_warning(docs, tmp_path):
    res = invoke("run", docs, "--out", tmp_path / "out", "--kv-cache", "fp4", "--device", "cpu", "--quiet")
    assert res.exit_code == 0, res.output
    assert res.stderr.splitlines() == ["warning: --kv-cache fp4 is meant for CUDA: on a CPU it runs the torch "
                                       "reference code, slower than without it"]


def test_the_gpu_warning_waits_for_the_engine_and_names_every_option():
    from docproc.pipeline.settings import RunSettings

    settings = RunSettings(inputs=["x"], out="o", model="m", kv_cache="fp4", quantization="fp8", draft="d")
    assert cli.gpu_only_options(settings) == ["--kv-cache fp4", "--quantization fp8", "--draft"]
    assert cli.gpu_only_options(RunSettings(inputs=["x"], out="o", model="m")) == []
    alone = cli.gpu_only_options(RunSettings(inputs=["x"], out="o", model="m", batch_invariant=True))
    assert alone == ["--batch-invariant"] and "sums may follow the row count" in cli.cpu_warning(alone)
    with pytest.raises(ValueError, match="--tensor-parallel-size 1"):
        RunSettings(inputs=["x"], out="o", model="m", batch_invariant=True, tensor_parallel_size=2)
    shown = []
    for device in ("cpu", "cuda:0"):
        display = cli._Display(quiet=True, log_json=False)
        loaded = []
        display.watch_device(["--draft", "--kv-cache fp4"], lambda: device if loaded else None)
        err = io.StringIO()
        cli.err_console, saved = Console(file=err, width=300), cli.err_console
        try:
            display("start", {"run_id": "r", "files": 1})  # the engine is not loaded yet
            loaded.append(True)
            for _ in range(2):
                display("batch", {})
        finally:
            cli.err_console = saved
        shown.append(err.getvalue().splitlines())
    assert shown == [["warning: --draft and --kv-cache fp4 are meant for CUDA: on a CPU they run the torch "
                      "reference code, slower than without them"], []]


def write_bpe_files(folder: Path) -> None:
    """vocab.json and merges.txt (the slow BPE files) of the bundled tokenizer."""
    bpe = json.loads((TARGET / "tokenizer.json").read_text())["model"]
    (folder / "vocab.json").write_text(json.dumps(bpe["vocab"]))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(
        (" ".join(m) if isinstance(m, list) else m) + "\n" for m in bpe["merges"]))


def test_which_tokenizer_files_a_folder_needs(tmp_path):
    from docproc.models.processor import load_tokenizer
    from docproc.models.tokenizer_files import missing_tokenizer

    assert missing_tokenizer(TARGET) is None
    folder = model_files(tmp_path / "bpe", "config.json", "tokenizer_config.json")
    assert "has no tokenizer.json (nor vocab.json and merges.txt)" in missing_tokenizer(folder)
    write_bpe_files(folder)
    # the bundled tokenizer_config names the generic backend, which needs tokenizer.json itself
    assert "tokenizer class TokenizersBackend needs" in missing_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    assert missing_tokenizer(folder) is None
    text = "Invoice <|im_start|> total 1,234.50"
    assert load_tokenizer(folder)(text)["input_ids"] == load_tokenizer(TARGET)(text)["input_ids"]


def test_the_drafts_tokenizer_check_names_a_missing_file_in_one_line(tmp_path):
    from docproc.engine.spec.draft import check_tokenizers
    from docproc.models.loader import CheckpointError

    folder = model_files(tmp_path / "draft", "config.json", "tokenizer_config.json")
    with pytest.raises(CheckpointError) as e:
        check_tokenizers(str(TARGET), str(folder))
    assert str(e.value) == (f"draft folder {folder} has no tokenizer.json (nor vocab.json and merges.txt): copy "
                            f"the tokenizer files from the checkpoint it was made from")

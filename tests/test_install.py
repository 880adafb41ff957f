"""What a CPU-only install gets: no Triton needed to run, and a command line that starts without
loading torch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NO_TRITON = "import sys; sys.modules['triton'] = None\n"  # `import triton` raises ImportError


@pytest.mark.parametrize("kv", ["auto", "fp4"])
@pytest.mark.slow
def test_the_cpu_engine_runs_without_triton(qwen2_vl_dir, kv):
    code = NO_TRITON + (
        "import os; os.environ.pop('TRITON_INTERPRET', None)\n"
        "from docproc import LLM, SamplingParams\n"
        "import kernels._triton as t; assert not t.HAVE_TRITON\n"
        f"llm = LLM({str(qwen2_vl_dir)!r}, device='cpu', kv_cache_dtype={kv!r})\n"
        "out = llm.generate(['the quick brown fox'], SamplingParams(max_tokens=5, ignore_eos=True))\n"
        "print(len(out[0].outputs[0].token_ids))\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "5"


def test_the_command_line_starts_without_torch():
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom docproc.cli import app\n"
            "for argv in (['--help'], ['run', '--help'], ['stats', '--help'], ['eval', '--help']):\n"
            "    assert CliRunner().invoke(app, argv).exit_code == 0, argv\n"
            "print('torch' in sys.modules, 'triton' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "False"]


def test_the_first_install_command_brings_a_grammar_backend():
    """README's first command (`pip install -e .`) installs what constrained decoding needs: the
    grammar backend is one of docproc's own dependencies, not an extra."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "xgrammar" for d in deps), deps
    from docproc.pipeline.constraints import xgrammar_available

    assert xgrammar_available()


def test_a_caller_expecting_hugging_faces_kernels_is_told_the_fix():
    """transformers 5.25 and later import Hugging Face's `kernels` distribution, whose import name
    is this project's kernel package: the pin keeps it out, and a caller that still reaches for it
    gets the fix, while this package's own modules import as before."""
    import tomllib

    import kernels
    from kernels import paged_attention  # noqa: F401  (a module of ours: the import system's path)

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "transformers>=5.0,<5.25" in deps
    with pytest.raises(ImportError, match=r"transformers<5\.25.*pip uninstall -y kernels"):
        from kernels import CUDAProperties  # noqa: F401
    assert not hasattr(kernels, "__wrapped__") and getattr(kernels, "anything_else", None) is None


def test_every_package_is_installed():
    """pyproject lists its packages by hand (`kernels` is also a Hugging Face distribution's name):
    a package left out works from a checkout (`pip install -e`) and is missing from a wheel."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.relative_to(ROOT).parent.parts) for top in ("docproc", "kernels")
             for p in (ROOT / top).rglob("__init__.py") if "assets" not in p.parts}
    assert found - listed == set()

"""The import structure docs/architecture.md draws: layers point down only (cli and ray ->
openai_compat -> pipeline -> engine -> models -> layers -> kernels; kernels import neither docproc nor anything but
torch and Triton), and no two modules import each other, directly or round a circle, counting the
imports inside functions (only `if TYPE_CHECKING:` blocks are left out)."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["docproc.cli", "docproc.ray", "docproc.openai_compat", "docproc.pipeline", "docproc.engine", "docproc.models",
          "docproc.layers", "kernels"]  # from the top; docproc's own small modules (errors, multimodal, config, ...) sit under all


def modules() -> dict[str, Path]:
    out = {}
    for pkg in ("docproc", "kernels"):
        for f in (ROOT / pkg).rglob("*.py"):
            rel = f.relative_to(ROOT).with_suffix("")
            out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file but under `if TYPE_CHECKING:`."""
    found: set[str] = set()

    def owner(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def visit(node) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(m for a in node.names if (m := owner(a.name)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                m = owner(f"{base}.{a.name}")
                if m:
                    found.add(m)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    found.discard(name)
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layer(name: str) -> int | None:
    for i, top in enumerate(LAYERS):
        if name == top or name.startswith(top + "."):
            return i
    return None


def test_layers_point_down_and_kernels_stand_alone():
    wrong = []
    for a, targets in graph().items():
        for b in targets:
            la, lb = layer(a), layer(b)
            if la is not None and lb is not None and lb < la:
                wrong.append(f"{a} -> {b} (up)")
            if la == len(LAYERS) - 1 and lb != la:
                wrong.append(f"{a} -> {b} (a kernel importing docproc)")
    assert not wrong, "\n".join(sorted(wrong))


def test_docprocs_own_small_modules_sit_under_every_layer():
    """docproc's modules outside the layers (errors, multimodal, config, outputs, ...) are shared by
    all of them, so they import none of them; the package and `python -m docproc` are the entries."""
    entries = {"docproc", "docproc.__main__"}
    wrong = [f"{a} -> {b}" for a, targets in graph().items() if layer(a) is None and a not in entries
             for b in targets if layer(b) is not None]
    assert not wrong, "\n".join(sorted(wrong))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_checks_see_a_cycle_and_an_upward_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    g = graph()
    assert "docproc.engine.tensor_parallel" in g["docproc.engine.model_runner"]  # a lazy import is seen
    assert layer("docproc.engine.llm") > layer("docproc.pipeline.run") and layer("kernels.fp8") == len(LAYERS) - 1

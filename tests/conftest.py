import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on CPU; set before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _interpreter_lists_builtins_once() -> None:
    """Triton's interpreter patches the builtins of triton.language, its tensor class and its math
    module around every kernel launch, and lists them each time with inspect.getmembers (in a
    profile of the constrained overlap test, 36 s of its 175: 82,000 listings). The patches are
    undone after each launch, so the list is the same every time: here it is made once per
    module. Where the interpreter's internals are not as expected, nothing changes."""
    try:
        import inspect

        from triton.runtime import interpreter as it
    except ImportError:
        return
    if not (callable(getattr(it, "_patch_builtin", None)) and callable(getattr(it, "_patch_attr", None))
            and list(inspect.signature(it._patch_builtin).parameters) == ["pkg", "builder", "scope"]):
        return
    listed: dict[int, tuple[object, list]] = {}

    def _patch_builtin(pkg, builder, scope):
        kept = listed.get(id(pkg))
        if kept is None or kept[0] is not pkg:
            kept = listed[id(pkg)] = (pkg, [(name, m) for name, m in inspect.getmembers(pkg) if it.tl.core.is_builtin(m)])
        for name, member in kept[1]:
            it._patch_attr(pkg, name, member, builder, scope)

    it._patch_builtin = _patch_builtin

    if callable(getattr(it, "_patch_lang", None)) and hasattr(it, "_LangPatchScope") \
            and callable(getattr(getattr(it, "GridExecutor", None), "__call__", None)):
        _device_calls_keep_the_launchs_patches(it, inspect)


def _device_calls_keep_the_launchs_patches(it, inspect) -> None:
    """A call of a @triton.jit function from inside a kernel patches the same modules again (and
    never undoes it: the launch's own restore does): 17 s of 108 in a cProfile of the constrained
    overlap test. Inside a launch whose patches are in place, a function that sees no other
    triton.language module is called as it is."""
    patch_lang, launch, launches = it._patch_lang, it.GridExecutor.__call__, []

    def _langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (it.tl, it.tl.core)}

    def _patch_lang_once(fn):
        if launches and launches[-1][1] and _langs(fn) <= launches[-1][0]:
            return it._LangPatchScope()
        scope = patch_lang(fn)
        if launches and not launches[-1][1]:  # the launch's own patches
            launches[-1][1] = True
        return scope

    def _launch(self, *args, **kwargs):
        launches.append([_langs(self.fn), False])
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    it._patch_lang = _patch_lang_once
    it.GridExecutor.__call__ = _launch


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_lists_builtins_once()

# the user's cache folder stays untouched (the weights' digests, models/digests.py): the tests'
# processes, and those they start, get one of their own
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="docproc-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)

sys.path.insert(0, str(Path(__file__).parent.parent))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # a pytest-xdist worker (README runs one per core): one intra-op thread, for it and for the
    # processes its tests start; two per process oversubscribe the cores and the suite took 21 min
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
else:
    torch.set_num_threads(min(2, os.cpu_count() or 1))


# Under pytest-xdist --dist loadfile the longest files start first. xdist's default order (the
# files with the most tests first) left test_ray.py's 150 s to the end on one worker, the other idle.
SLOW_FILES = ("test_ray.py", "test_graph_runner.py", "test_train_tiny.py", "test_tensor_parallel.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    config.option.loadscopereorder = False  # the workers' collection order, SLOW_FILES first
    return None  # xdist's own scheduler


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(SLOW_FILES)}
        items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def qwen2_vl_dir(tmp_path_factory):
    from fixtures.checkpoints import make_model

    return make_model(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", naming="new")


@pytest.fixture(scope="session")
def qwen2_vl_hd128_dir(tmp_path_factory):
    from fixtures.checkpoints import make_model

    # head_dim 128, GQA 2: the shapes the Gluon FP4 decode kernel takes
    return make_model(tmp_path_factory.mktemp("qwen2_vl_hd128"), "qwen2_vl", naming="new", geometry="tiny-hd128")


@pytest.fixture(scope="session")
def qwen2_5_vl_dir(tmp_path_factory):
    from fixtures.checkpoints import make_model

    # published key naming, two shards, tied embeddings: the other half of the loader's matrix
    return make_model(tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl", naming="published", shards=2, tie=True)


@pytest.fixture(scope="session")
def qwen3_vl_dir(tmp_path_factory):
    from fixtures.checkpoints import make_model

    # Qwen3-VL: head size 32 apart from hidden / heads, DeepStack from two tower blocks, untied
    return make_model(tmp_path_factory.mktemp("qwen3_vl"), "qwen3_vl", naming="new", geometry="tiny-qwen3")


@pytest.fixture(scope="module")
def one_query(tmp_path_factory) -> Path:
    """A query set of one short string query: a run's figures without the whole default set's cost."""
    q = tmp_path_factory.mktemp("queries") / "one.toml"
    q.write_text('name = "one"\n\n[[query]]\nname = "vendor"\nquestion = "What is the vendor name?"\n'
                 'type = "string"\nmax_tokens = 4\n')
    return q

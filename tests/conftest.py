import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on CPU; set before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent.parent))
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
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

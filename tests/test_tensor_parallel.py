"""Tensor parallelism on CPU (gloo, float32, the tiny random model: 4 heads, 2 KV heads): greedy
tokens at tensor_parallel_size 2 and 4 (KV heads split, then replicated) equal one rank's, for
prompts with 0-2 images, a batch, chunked prefill and prefix hits; with a one-rank draft; with
FP4 KV; with FP8 weights (both checkpoint layouts, a block split inside a rank's columns, and
quantization at load). A killed rank ends the engine with an error at once (a device fault:
exit 4 in a docproc run). (One rank's tokens equal
transformers': tests/test_parity.py.)"""
from __future__ import annotations

import time

import pytest
import torch
from PIL import Image

from docproc import LLM, SamplingParams
from docproc.engine.tensor_parallel import TensorParallelError

pytestmark = pytest.mark.skipif(not __import__("torch").distributed.is_available(), reason="no torch.distributed")

PAD = "<|vision_start|><|image_pad|><|vision_end|>"


def prompts():
    red, blue = Image.new("RGB", (64, 48), (200, 30, 30)), Image.new("RGB", (40, 72), (20, 40, 220))
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    return [chat.format("Read the invoice number, the date and the total, please."),
            {"prompt": chat.format(PAD + "What is the total?"), "multi_modal_data": {"image": [red]}},
            {"prompt": chat.format(PAD + PAD + "Compare the pages."), "multi_modal_data": {"image": [red, blue]}}]


def tokens(llm, ps, n=10):
    return [o.outputs[0].token_ids for o in llm.generate(ps, SamplingParams(max_tokens=n, ignore_eos=True))]


def engine(folder, tp, **kw):
    # a small token budget: the image prompts are prefilled in several chunks
    return LLM(str(folder), device="cpu", dtype="float32", max_num_batched_tokens=32, tensor_parallel_size=tp, **kw)


@pytest.mark.slow
def test_two_ranks_give_one_ranks_tokens(qwen2_vl_dir):
    ps = prompts()
    one = engine(qwen2_vl_dir, 1)
    want = tokens(one, ps)
    want_spec = tokens(engine(qwen2_vl_dir, 1, kv_cache_dtype="fp4"), ps)
    llm = engine(qwen2_vl_dir, 2)
    try:
        text = llm.runner.model.text
        assert text.layers[0].self_attn.q_proj.weight.shape[0] == 2 * 32  # 2 of the 4 heads (head_dim 32)
        assert text.embed_tokens.weight.shape[0] == 384 // 2
        assert llm.runner.model.text_fingerprint != one.runner.model.text_fingerprint
        assert tokens(llm, ps) == want
        again = llm.generate(ps, SamplingParams(max_tokens=10, ignore_eos=True))  # the prefixes are cached now
        assert [o.outputs[0].token_ids for o in again] == want
        assert all(o.metrics.num_cached_tokens > 0 for o in again)
    finally:
        llm.close()
    fp4 = engine(qwen2_vl_dir, 2, kv_cache_dtype="fp4")
    try:
        assert tokens(fp4, ps) == want_spec  # each rank's share of the FP4 cache
    finally:
        fp4.close()
    spec = engine(qwen2_vl_dir, 2, speculative_model=str(qwen2_vl_dir), num_speculative_tokens=3,
                  speculative_draft_tensor_parallel_size=1)
    try:
        assert tokens(spec, ps) == want  # the draft whole on rank 0, verified by the split target
        assert spec.spec_info()["draft_accepted"] > 0
    finally:
        spec.close()


@pytest.mark.slow
def test_fp8_weights_split_over_two_ranks_give_one_ranks_tokens(qwen2_vl_dir, tmp_path):
    """Each rank's FP8 share: codes sliced as the float weights are, with the scales of its rows
    (q/k/v, gate/up) or columns (o, down). In blocks 48 columns wide the splits of the tiny
    model's o (at column 64) and down (at 128) fall inside a block: rank 0's shares end in a part
    of one, rank 1's start in one and are regrouped by 16 (tests/test_fp8.py checks the
    regrouping's values directly). Quantization at load takes each row's scale over the whole row, so the
    ranks' codes are one rank's, as are the tokens (float32, the dequantized products)."""
    from docproc.models.quant import Fp8Weight
    from fixtures.checkpoints import to_fp8

    ps = prompts()
    cases = [(to_fp8(qwen2_vl_dir, tmp_path / "ct", "compressed-tensors"), {}),
             (to_fp8(qwen2_vl_dir, tmp_path / "block", "block", block=(32, 48)), {}),
             (qwen2_vl_dir, {"quantization": "fp8"})]
    for folder, kw in cases:
        one = engine(folder, 1, **kw)
        want = tokens(one, ps)
        whole = one.runner.model.text.layers[0]
        llm = engine(folder, 2, **kw)
        try:
            layer = llm.runner.model.text.layers[0]
            o, down, qkv = layer.self_attn.o_weight, layer.mlp.down_weight, layer.self_attn.qkv_weight
            assert isinstance(o, Fp8Weight) and o.shape == (128, 64) and down.shape == (128, 128)
            if "block" in str(folder):
                assert o.group == 48 and o.scale.shape == (128, 2)  # columns 0-47 and 48-63 of 48-64
            # rank 0 holds exactly the first columns of one rank's o and down and the first rows of its q
            assert torch.equal(o.dequantize(), whole.self_attn.o_weight.dequantize()[:, :64])
            assert torch.equal(down.dequantize(), whole.mlp.down_weight.dequantize()[:, :128])
            assert torch.equal(qkv.dequantize()[:64], whole.self_attn.qkv_weight.dequantize()[:64])
            assert llm.cache_info()["weights_fp8"] == one.cache_info()["weights_fp8"]
            assert tokens(llm, ps) == want, folder
        finally:
            llm.close()


@pytest.mark.slow
def test_four_ranks_replicate_the_kv_heads(qwen2_vl_dir):
    ps = prompts()
    want = tokens(engine(qwen2_vl_dir, 1), ps)
    llm = engine(qwen2_vl_dir, 4)
    try:
        assert llm.runner.text_config.kv_heads == 1 and llm.runner.text_config.heads == 1
        assert tokens(llm, ps) == want
    finally:
        llm.close()


@pytest.mark.slow
def test_a_killed_rank_ends_the_engine_with_an_error(qwen2_vl_dir, tmp_path):
    """Killed under a docproc run after its first document, the rank's death is a device fault:
    the run stops with exit 4, the finished document kept and no error row for the others (not
    one each). (And a second engine while one is open is refused clearly, the open one unharmed.)"""
    from docproc.pipeline.run import Pipeline, RunSettings
    from docproc.pipeline.schema import read_table

    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    for i, name in enumerate("abc"):  # noise: a blank page would be answered without the engine
        Image.effect_noise((64, 48), 40 + i).convert("RGB").save(docs / f"{name}.png")
    queries = tmp_path / "q.toml"
    queries.write_text('[[query]]\nname = "vendor"\nquestion = "Vendor?"\ntype = "string"\nmax_tokens = 2\n')
    llm = engine(qwen2_vl_dir, 2)
    killed_at = []

    def kill_after_the_first_batch(event, data):
        if event == "batch" and not killed_at:
            proc = llm.runner.tp.procs[0]
            proc.kill()
            proc.join(10)
            killed_at.append(time.perf_counter())

    try:
        with pytest.raises(TensorParallelError, match="another tensor-parallel engine is open"):
            engine(qwen2_vl_dir, 2)
        settings = RunSettings(inputs=[str(docs)], out=str(out), model=str(qwen2_vl_dir), queries=str(queries),
                               device="cpu", batch_pages=1)
        manifest = Pipeline(settings, llm=llm, reporter=kill_after_the_first_batch).run()
        assert time.perf_counter() - killed_at[0] < 30
        assert (manifest["status"], manifest["exit_code"], manifest["fault"]["kind"]) == ("failed", 4, "device")
        assert "rank 1 died" in manifest["fault"]["message"]
        assert [r["path"] for r in read_table(out / "results.parquet").to_pylist()] == ["a.png"]
        assert manifest["totals"]["errors"] == 0
        with pytest.raises(TensorParallelError, match="rank 1 died"):  # and it stays down
            tokens(llm, prompts()[:1], n=2)
    finally:
        llm.close()


def test_splits_that_cannot_be_made_are_refused(qwen2_vl_dir):
    with pytest.raises(ValueError, match="4 attention heads"):
        engine(qwen2_vl_dir, 3)
    with pytest.raises(ValueError, match="draft runs whole on rank 0"):
        engine(qwen2_vl_dir, 2, speculative_model=str(qwen2_vl_dir), speculative_draft_tensor_parallel_size=2)


@pytest.mark.slow
def test_docproc_run_with_two_ranks_answers_as_one(tmp_path):
    """The CLI end to end on the bundled target, whose vocabulary of 899 the ranks do not divide
    (the last rank's rows padded): the same answers as one rank, and the ranks stopped after."""
    import shutil
    from pathlib import Path

    from typer.testing import CliRunner

    from docproc.cli import app
    from docproc.pipeline.schema import read_table

    docs = tmp_path / "docs"
    docs.mkdir()
    for n in ("doc_2026_00003.jpg",):
        shutil.copy(Path(__file__).resolve().parent.parent / "sample_docs" / n, docs / n)
    queries = tmp_path / "q.toml"
    queries.write_text('name = "two"\n\n[[query]]\nname = "vendor"\nquestion = "What is the vendor name?"\n'
                       'type = "string"\n\n[[query]]\nname = "total"\nquestion = "What is the total amount?"\n'
                       'type = "number"\n')
    got = {}
    for tp in (1, 2):
        out = tmp_path / f"out{tp}"
        res = CliRunner().invoke(app, ["run", str(docs), "--out", str(out), "--device", "cpu", "--quiet",
                                       "--queries", str(queries), "--tensor-parallel-size", str(tp)])
        assert res.exit_code == 0, res.output
        got[tp] = {(r["path"], r["query"]): (r["answer"], r["value"]) for r in read_table(out / "results.parquet").to_pylist()}
        # the run closed its engine: its ranks stopped and the process group is gone (the result
        # still holds the run's frames, so the engine is not left to the garbage collector)
        assert not __import__("torch").distributed.is_initialized()
    assert got[2] == got[1] and len(got[1]) == 2 and any(v[1] for v in got[1].values())


@pytest.mark.slow
def test_a_script_without_the_main_guard_gets_one_clear_error(qwen2_vl_dir, tmp_path):
    """The ranks are spawned processes, which import the script again: without the guard, rank 1
    dies as it starts and rank 0 says so at once (no wait for a rank that will never join)."""
    import subprocess
    import sys

    script = tmp_path / "noguard.py"
    script.write_text(f"from docproc import LLM\nLLM({str(qwen2_vl_dir)!r}, device='cpu', tensor_parallel_size=2)\n")
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "TensorParallelError" in res.stderr and "__main__" in res.stderr, res.stderr[-2000:]
    assert time.perf_counter() - t0 < 60


def _two_shards(src, dst, change):
    """src's checkpoint written as two files, the vision tower's first, after change(tensors)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    tensors = change(load_file(str(src / "model.safetensors")))
    names = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if "visual" in k},
             "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if "visual" not in k}}
    for name, part in names.items():
        save_file(part, str(dst / name))
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: name for name, part in names.items() for k in part}}))
    return dst


@pytest.mark.slow
def test_a_load_that_fails_on_one_rank_ends_at_once_with_its_error(qwen2_vl_dir, tmp_path):
    """Rank 0 fails on a vision weight (only it reads the tower) while rank 1 loads on, with FP8
    quantized at load (whose row maxima the ranks agree on with a collective): the error is the
    checkpoint's, at once, and rank 1 is stopped rather than left waiting in that collective.
    Split, a tensor whose share would fit but whose whole does not is refused too."""
    import multiprocessing

    from docproc.models.loader import CheckpointError

    def narrow_vision(t):
        t["model.visual.blocks.0.mlp.fc1.weight"] = t["model.visual.blocks.0.mlp.fc1.weight"][:-1]
        return t

    bad = _two_shards(qwen2_vl_dir, tmp_path / "vision", narrow_vision)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match="visual.blocks.0.mlp.fc1.weight"):
        engine(bad, 2, quantization="fp8")
    assert time.perf_counter() - t0 < 60
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("docproc-tp")]

    def narrow_o(t):  # rank 0's columns (0-63) are all there; rank 1's (64-127) are cut short
        k = "model.language_model.layers.1.self_attn.o_proj.weight"
        t[k] = t[k][:, :96].contiguous()
        return t

    with pytest.raises(CheckpointError, match=r"o_proj.weight' has shape \(128, 96\) but the config implies"):
        engine(_two_shards(qwen2_vl_dir, tmp_path / "o", narrow_o), 2, quantization="fp8")


def test_rank_0_names_a_rank_that_failed_to_load():
    """wait_loaded: a rank's failure, recorded in the group's store, is raised on rank 0 with that
    rank's error (a CheckpointError as such), and the ranks are stopped."""
    import datetime

    import torch.distributed as dist

    from docproc.engine.tensor_parallel import TensorParallelGroup, _free_port
    from docproc.models.loader import CheckpointError

    class Proc:
        exitcode = None
        killed = False

        def is_alive(self):
            return not self.killed

        def kill(self):
            self.killed = True

        def join(self, timeout=None):
            pass

    store = dist.TCPStore("127.0.0.1", _free_port(), 3, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    group = object.__new__(TensorParallelGroup)
    group.size, group.store, group.failed, group.procs = 3, store, None, [Proc(), Proc()]
    store.set("loaded1", "1")
    store.set("failed2", "CheckpointError\n/m: weight 'x' has shape (1,) but the config implies (2,)")
    with pytest.raises(CheckpointError, match=r"weight 'x' has shape \(1,\)"):
        group.wait_loaded()
    assert all(p.killed for p in group.procs)
    group.procs, group.failed = [Proc(), Proc()], None
    store.delete_key("failed2")
    store.set("failed2", "OutOfMemoryError\nCUDA out of memory")
    with pytest.raises(TensorParallelError, match="rank 2 failed to load its share: OutOfMemoryError"):
        group.wait_loaded()
    group.procs, group.failed = [Proc(), Proc()], None
    store.delete_key("failed2")
    store.set("loaded2", "1")
    group.wait_loaded()  # every rank loaded

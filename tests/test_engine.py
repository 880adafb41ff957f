"""End-to-end engine behaviour on a tiny random model (CPU): sampling, stops, errors, caches."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from docproc import LLM, SamplingParams
from docproc.models.loader import CheckpointError

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def page(seed: int, w: int = 120, h: int = 90) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def llm(qwen2_vl_dir):
    return LLM(str(qwen2_vl_dir), device="cpu")


def test_seeded_sampling_reproduces_itself_whatever_the_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate(["Invoice total?"], sp)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = llm.generate(["receipt", "Invoice total?", "vendor"], [other, sp, other])
    assert batch[1].outputs[0].token_ids == alone
    unseeded = llm.generate(["Invoice total?"] * 2, other)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_top_k_1_is_greedy(llm):
    greedy = llm.generate(["Due date"], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    k1 = llm.generate(["Due date"], SamplingParams(temperature=0.7, top_k=1, max_tokens=10, ignore_eos=True,
                                                    seed=3))[0]
    assert k1.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_stop_string_truncates_text(llm):
    full = llm.generate(["the quick"], SamplingParams(max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = llm.generate(["the quick"], SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.find(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]


def test_eos_ends_generation_unless_ignored(llm):
    full = llm.generate(["hello"], SamplingParams(max_tokens=30, ignore_eos=True))[0].outputs[0]
    eos = full.token_ids[4]
    llm.eos_token_ids.add(eos)
    try:
        out = llm.generate(["hello"], SamplingParams(max_tokens=30))[0].outputs[0]
        first = full.token_ids.index(eos)
        assert out.finish_reason == "stop" and out.stop_reason == eos
        assert out.token_ids == full.token_ids[: first + 1]
        ign = llm.generate(["hello"], SamplingParams(max_tokens=30, ignore_eos=True))[0].outputs[0]
        assert ign.finish_reason == "length" and len(ign.token_ids) == 30
    finally:
        llm.eos_token_ids.discard(eos)


def test_eos_ids_come_from_generation_config(llm):
    assert llm.eos_token_ids == {2}


def test_request_longer_than_max_model_len_fails_alone(qwen2_vl_dir):
    small = LLM(str(qwen2_vl_dir), device="cpu", max_model_len=40)
    outs = small.generate(["short", "word " * 60, {"prompt": "two pads " + IMG, "multi_modal_data": {"image": []}}],
                          SamplingParams(max_tokens=8, ignore_eos=True))
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 8
    assert outs[1].outputs[0].finish_reason == "error" and "max_model_len" in outs[1].error
    assert "placeholder" in outs[2].error
    # generation stops at max_model_len
    near = small.generate([{"prompt_token_ids": [10] * 30}], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert len(near.prompt_token_ids) == 30
    assert len(near.prompt_token_ids) + len(near.outputs[0].token_ids) == 40
    assert near.outputs[0].finish_reason == "length"


def test_unreadable_image_fails_alone(llm):
    outs = llm.generate([{"prompt": IMG + "x", "multi_modal_data": {"image": [b"not an image"]}}, "fine"],
                        SamplingParams(max_tokens=4))
    assert outs[0].error and "cannot read image" in outs[0].error
    assert outs[1].error is None


def test_images_as_path_bytes_or_pil_share_the_encoder_and_prefix_cache(qwen2_vl_dir, tmp_path):
    llm = LLM(str(qwen2_vl_dir), device="cpu")
    img = page(5)
    path = tmp_path / "p.png"
    img.save(path)
    prompt = "<|im_start|>user\n" + IMG + "What is the total?"
    reqs = [{"prompt": prompt, "multi_modal_data": {"image": [x]}} for x in (img, str(path), path.read_bytes())]
    outs = llm.generate(reqs, SamplingParams(max_tokens=6, ignore_eos=True))
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    info = llm.cache_info()
    assert info["num_encoded_images"] == 1
    assert sum(o.metrics.num_encoded_images for o in outs) == 1
    assert all(o.metrics.num_cached_tokens > 0 for o in outs[1:])
    # the vision cache's hit rate: every image a step needs, found without an encode or not (its
    # reads of what it encoded counted as hits too, so the rate was 1 whatever happened)
    cold = LLM(str(qwen2_vl_dir), device="cpu", enable_prefix_caching=False)
    cold.generate(reqs, SamplingParams(max_tokens=2, ignore_eos=True))
    info = cold.cache_info()
    assert (info["encoder_cache_lookups"], info["encoder_cache_hits"], info["num_encoded_images"]) == (3, 2, 1)
    # a prompt of two pages prefilled in small chunks: each image counted once, not at every chunk
    chunked = LLM(str(qwen2_vl_dir), device="cpu", enable_prefix_caching=False, max_num_batched_tokens=16)
    chunked.generate({"prompt": "<|im_start|>user\n" + IMG + IMG + "Totals?", "multi_modal_data": {
        "image": [page(6), page(7)]}}, SamplingParams(max_tokens=1))
    info = chunked.cache_info()
    assert (info["encoder_cache_lookups"], info["encoder_cache_hits"], info["num_encoded_images"]) == (2, 0, 2)
    # a step with more images than the vision cache keeps (its first ones were evicted by its last
    # before the step read them: TypeError)
    three = {"prompt": "<|im_start|>user\n" + IMG * 3 + "Totals?", "multi_modal_data": {"image": [page(6), page(7),
                                                                                                     page(8)]}}
    small = LLM(str(qwen2_vl_dir), device="cpu", encoder_cache_entries=2).generate(three, SamplingParams(max_tokens=3))
    assert small[0].error is None and small[0].outputs[0].token_ids == \
        cold.generate(three, SamplingParams(max_tokens=3))[0].outputs[0].token_ids


def test_metrics_and_cache_info(llm):
    out = llm.generate([{"prompt": IMG + "total", "multi_modal_data": {"image": [page(9)]}}],
                       SamplingParams(max_tokens=5, ignore_eos=True))[0]
    m = out.metrics
    assert m.num_prompt_tokens == len(out.prompt_token_ids) and m.num_generated_tokens == 5
    assert m.num_images == 1 and m.finish_reason == "length"
    assert 0 < m.time_to_first_token <= m.total_time
    assert m.draft_proposed == 0 and m.draft_accepted == 0
    info = llm.cache_info()
    cfg = llm.runner.text_config
    assert info["bytes_per_token"] == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert info["allocated_bytes"] == info["num_blocks"] * info["block_size"] * info["bytes_per_token"]
    assert info["kv_cache_dtype"] == "fp32" and info["block_size"] == 16


def test_preemption_by_recompute_keeps_greedy_output(qwen2_vl_dir):
    prompts = [f"<|im_start|>user\nquestion {i} about the invoice total" for i in range(6)]
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = LLM(str(qwen2_vl_dir), device="cpu", enable_prefix_caching=False).generate(prompts, sp)
    tight = LLM(str(qwen2_vl_dir), device="cpu", num_kv_blocks=12, enable_prefix_caching=False)
    outs = tight.generate(prompts, sp)
    assert tight.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert not any(tight.block_manager.ref_counts)


def test_kv_cache_dtype_bf16_on_cpu(qwen2_vl_dir):
    llm = LLM(str(qwen2_vl_dir), device="cpu", kv_cache_dtype="bf16")
    info = llm.cache_info()
    assert info["kv_cache_dtype"] == "bf16"
    cfg = llm.runner.text_config
    assert info["bytes_per_token"] == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    assert len(llm.generate(["hi"], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3


def test_bad_arguments_raise_clear_errors(qwen2_vl_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(qwen2_vl_dir), device="cpu", kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(str(qwen2_vl_dir), device="cpu", max_model_len=10**6)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


# ---- loader ----------------------------------------------------------------------------------
def test_loader_errors_name_what_is_wrong(tmp_path, qwen2_vl_dir):
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(str(tmp_path / "nope"), device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        LLM(str(tmp_path / "empty"), device="cpu")
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type 'llama' is not supported"):
        LLM(str(llama), device="cpu")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for f in qwen2_vl_dir.iterdir():
        if f.suffix != ".safetensors":
            (pickled / f.name).write_bytes(f.read_bytes())
    (pickled / "pytorch_model.bin").write_bytes(b"\x80")
    with pytest.raises(CheckpointError, match="pickle"):
        LLM(str(pickled), device="cpu")
    for field, value, message in (("hidden_size", "wide", "hidden_size must be a positive integer, got 'wide'"),
                                  ("vision_config", [1], "vision_config must be an object")):
        broken = tmp_path / f"broken_{field}"
        broken.mkdir()
        for f in qwen2_vl_dir.iterdir():
            (broken / f.name).symlink_to(f)
        raw = json.loads((qwen2_vl_dir / "config.json").read_text())
        (raw["text_config"] if field in raw.get("text_config", {}) else raw)[field] = value
        (broken / "config.json").unlink()
        (broken / "config.json").write_text(json.dumps(raw))
        with pytest.raises(CheckpointError, match=message):
            LLM(str(broken), device="cpu")


def test_loader_reports_missing_weights(tmp_path, qwen2_vl_dir):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in qwen2_vl_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    state = load_file(str(broken / "model.safetensors"))
    del state["model.language_model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.1.mlp.up_proj.weight"):
        LLM(str(broken), device="cpu")


def test_both_namings_load_the_same_weights(tmp_path):
    from fixtures.checkpoints import make_model

    a = LLM(str(make_model(tmp_path / "a", naming="new", seed=4)), device="cpu")
    b = LLM(str(make_model(tmp_path / "b", naming="published", shards=3, seed=4)), device="cpu")
    assert a.runner.model.text_fingerprint == b.runner.model.text_fingerprint
    assert a.runner.model.vision_fingerprint == b.runner.model.vision_fingerprint
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    req = {"prompt": IMG + "total", "multi_modal_data": {"image": [page(1)]}}
    assert a.generate([req], sp)[0].outputs[0].token_ids == b.generate([req], sp)[0].outputs[0].token_ids


def test_bf16_checkpoint_loads(tmp_path):
    from fixtures.checkpoints import make_model

    folder = make_model(tmp_path / "bf16", dtype=torch.bfloat16)
    llm = LLM(str(folder), device="cpu")
    assert llm.runner.dtype == torch.float32  # auto on CPU computes in float32
    assert llm.runner.model.text.embed_tokens.weight.dtype == torch.float32
    llm16 = LLM(str(folder), device="cpu", dtype="bfloat16")
    assert llm16.cache_info()["kv_cache_dtype"] == "bf16"
    assert len(llm16.generate(["x"], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids) == 4


def test_weights_read_straight_from_the_file_equal_safetensors_reads(qwen2_vl_dir, monkeypatch):
    """A tensor stored in its parameter's dtype and shape is read from the file into the parameter
    (on CUDA through pinned buffers), its digest from the file's bytes: parameters and fingerprints
    equal those of the safetensors path, which tensors in another dtype still take."""
    import docproc.models.loader as loader

    reads = []
    read = loader._Reader.read
    monkeypatch.setattr(loader._Reader, "read", lambda self, path, fd, offset, nbytes, p: (
        reads.append(nbytes), read(self, path, fd, offset, nbytes, p)))
    direct = loader.load_model(qwen2_vl_dir, torch.device("cpu"), torch.float32)
    assert len(reads) > 20  # (the fixture stores float32: every tensor but none goes straight in)
    layout = loader.tensor_layout
    monkeypatch.setattr(loader, "tensor_layout", lambda path, fd: {
        k: (None, *rest) for k, (_, *rest) in layout(path, fd).items()})
    reads.clear()
    ref = loader.load_model(qwen2_vl_dir, torch.device("cpu"), torch.float32)
    assert reads == []
    for a, b in ((direct.text, ref.text), (direct.vision, ref.vision)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert (direct.text_fingerprint, direct.vision_fingerprint, direct.vision_trunk_fingerprint) == \
        (ref.text_fingerprint, ref.vision_fingerprint, ref.vision_trunk_fingerprint)


def test_a_weights_file_that_is_not_a_regular_file_is_named(tmp_path):
    """A *.safetensors that is a FIFO (opening it would wait for a writer forever) or a folder
    stops the load with one line naming it."""
    from docproc.models.loader import weight_files

    os.mkfifo(tmp_path / "a.safetensors")
    (tmp_path / "b.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="a.safetensors, b.safetensors are not regular files"):
        weight_files(tmp_path)


def test_weight_digests_are_kept_for_the_next_load_of_the_same_unchanged_files(tmp_path, monkeypatch):
    """A load takes the digests an earlier load kept for the same file (device, inode, size,
    modification and change times) instead of hashing it again, with the same fingerprints; a file
    changed since, even with its size and modification time put back, is hashed again; a file
    changed moments before its load is not remembered; an unwritable cache changes nothing."""
    import docproc.models.digests as digests
    import docproc.models.loader as loader
    from fixtures.checkpoints import make_model

    folder = make_model(tmp_path / "m", shards=2)
    cache = tmp_path / "digests"
    hashed = []
    sha = loader._sha256_range
    monkeypatch.setattr(loader, "_sha256_range", lambda *a: (hashed.append(a[0].name), sha(*a))[1])

    def load(where=cache):
        hashed.clear()
        m = loader.load_model(folder, torch.device("cpu"), torch.float32, digest_cache=where)
        return m.text_fingerprint, m.vision_fingerprint, m.vision_trunk_fingerprint

    fresh = load()  # (the fixture's files were written just now: racy, not remembered)
    assert hashed and not cache.exists()
    monkeypatch.setattr(digests, "RACY_SECONDS", 0.0)
    assert load() == fresh and len(set(hashed)) == 2 and len(list(cache.glob("*.json"))) == 2
    assert load() == fresh and hashed == []  # every digest from the cache
    shard = sorted(folder.glob("*.safetensors"))[1]
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor, size and modification time put back
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = load()
    assert set(hashed) == {shard.name} and changed != fresh
    assert load() == changed and hashed == []
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache's folder would be")
    assert load(blocked) == changed and hashed  # hashed, nothing kept, no error
    assert load(None) == changed and hashed
    with pytest.raises(ValueError, match="not an empty string"):  # ("" would be the working folder)
        LLM(str(folder), device="cpu", weight_digest_cache="")
    # entries not to be trusted are not read: a link, one others may write, one nested too deep
    # to parse, digests that are not hex; each load then hashes (the same fingerprints)
    entries = sorted(cache.glob("*.json"))
    bad = tmp_path / "bad.json"
    bad.write_bytes(entries[0].read_bytes())
    for spoil in (lambda e: (e.unlink(), e.symlink_to(bad)), lambda e: e.chmod(0o666),
                  lambda e: e.write_bytes(b"[" * 100000),
                  lambda e: e.write_text(re.sub(r'"[0-9a-f]{64}"', '"' + "Z" * 64 + '"', e.read_text(), count=1))):
        shutil.rmtree(cache)
        assert load() == changed and load() == changed and hashed == []  # (kept again)
        for e in cache.glob("*.json"):
            spoil(e)
        assert load() == changed and hashed, spoil
    # a file changed while it is read keeps nothing from that load
    shutil.rmtree(cache)
    real = loader._sha256_range

    def change_it(path, fd, offset, nbytes):
        digest = real(path, fd, offset, nbytes)
        if path == shard:
            os.utime(shard)  # (a write would do the same to its times)
        return digest

    monkeypatch.setattr(loader, "_sha256_range", lambda *a: (hashed.append(a[0].name), change_it(*a))[1])
    load()
    assert {json.loads(e.read_text())["path"] for e in cache.glob("*.json")} == \
        {os.path.realpath(f) for f in folder.glob("*.safetensors")} - {os.path.realpath(shard)}


def test_a_damaged_weights_file_is_named(tmp_path):
    """safetensors' own errors name no file: the load's does (one shard of three cut short, and one
    whose header is garbage)."""
    from fixtures.checkpoints import make_model

    folder = make_model(tmp_path / "m", shards=3)
    shard = sorted(folder.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shard.name} is not a readable safetensors file"):
        LLM(str(folder), device="cpu")
    shard.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=f"{shard.name} is not a readable safetensors file"):
        LLM(str(folder), device="cpu")


def test_a_checkpoint_file_that_is_a_fifo_is_named_before_anything_reads_it(tmp_path):
    """A tokenizer or config file that is a FIFO (reading it waits for a writer: `docproc run`
    hung in the tokenizer check) stops the API's load and the CLI's run with one line naming it."""
    from docproc.models.loader import check_folder

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    os.mkfifo(model / "tokenizer_config.json")
    with pytest.raises(CheckpointError, match="holds tokenizer_config.json, not regular files"):
        check_folder(model)
    (tmp_path / "docs").mkdir()
    Image.new("RGB", (32, 32), "white").save(tmp_path / "docs" / "a.png")
    proc = subprocess.run([sys.executable, "-m", "docproc", "run", str(tmp_path / "docs"), "--out", str(tmp_path / "out"),
                           "--model", str(model)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "tokenizer_config.json, not regular files" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
    (model / "tokenizer_config.json").unlink()
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")  # named as what it is, not as missing
    proc = subprocess.run([sys.executable, "-m", "docproc", "run", str(tmp_path / "docs"), "--out", str(tmp_path / "out"),
                           "--model", str(model)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "holds config.json, not regular files" in proc.stderr + proc.stdout


def test_a_read_through_the_staging_buffers_equals_the_file(tmp_path, monkeypatch):
    """The GPU's path, chunk by chunk on four threads through eight buffers (here of 333 bytes, on the host):
    every tensor's bytes as stored, whatever the chunk boundaries; its digest from the file equals
    the digest of the tensor safetensors reads."""
    from safetensors.torch import save_file

    import docproc.models.loader as loader

    torch.manual_seed(0)
    tensors = {"a": torch.randn(37, 29), "b": torch.randn(5, 7).to(torch.bfloat16), "c": torch.randn(3)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    reader = loader._Reader(torch.device("cpu"), stage_bytes=333, staged=True)
    chunks = []
    pread = loader._pread_into
    monkeypatch.setattr(loader, "_pread_into", lambda *a: (chunks.append(len(a[2])), pread(*a)))
    with open(path, "rb") as f:
        layout = loader.tensor_layout(path, f.fileno())
        for name, ref in tensors.items():
            kind, shape, offset, nbytes = layout[name]
            assert (kind, shape, nbytes) == (ref.dtype, tuple(ref.shape), ref.numel() * ref.element_size())
            out = torch.full_like(ref, -1.0)
            reader.read(path, f.fileno(), offset, nbytes, out)
            reader.wait()
            assert torch.equal(out, ref), name
            assert loader._sha256_range(path, f.fileno(), offset, nbytes) == loader._sha256((ref,))
    reader.finish()
    assert len(chunks) == 15 and max(chunks) == 333  # (37 * 29 * 4 bytes in 13 chunks, the others in one each)
    # a file cut short under a staged read: its thread's error reaches the loading thread at wait()
    kind, shape, offset, nbytes = layout["a"]
    path.write_bytes(path.read_bytes()[: offset + nbytes // 2])
    reader = loader._Reader(torch.device("cpu"), stage_bytes=333, staged=True)
    with open(path, "rb") as f:
        reader.read(path, f.fileno(), offset, nbytes, torch.empty_like(tensors["a"]))
        with pytest.raises(CheckpointError, match="ended inside a tensor"):
            reader.wait()
    reader.finish()


def test_a_meta_module_is_given_memory_once_in_its_final_dtype():
    """materialize() gives what to_empty(device).to(dtype) gives (floating tensors in the dtype,
    others as built, a tensor registered twice still one tensor), without allocating the
    construction dtype first."""
    from docproc.models.loader import materialize

    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
        m[2].weight = torch.nn.Parameter(torch.zeros(4, 8))
        m.register_buffer("index", torch.zeros(3, dtype=torch.int64))
        m[1].register_buffer("scale", torch.zeros(8))
        m.add_module("tied", torch.nn.Linear(8, 4, bias=False))
        m.tied.weight = m[2].weight
    out = materialize(m, torch.device("cpu"), torch.bfloat16)
    assert out is m
    for name, t in [*m.named_parameters(), *m.named_buffers()]:
        assert t.device.type == "cpu", name
        assert t.dtype == (torch.int64 if name == "index" else torch.bfloat16), name
    assert isinstance(m[0].weight, torch.nn.Parameter) and m[0].weight.requires_grad
    assert m.tied.weight is m[2].weight
    assert [p.shape for p in m.parameters()] == [(8, 4), (8,), (8,), (8,), (4, 8), (4,)]


def test_fused_projections_equal_the_separate_ones(qwen2_vl_dir):
    """q/k/v and gate/up run as one matmul each after loading; the parameters are views of the
    fused tensors (same names and values), and the outputs equal the unfused model's."""
    from docproc.models.loader import load_model

    model = load_model(qwen2_vl_dir, torch.device("cpu"), torch.float32)
    text = model.text
    attn, mlp = text.layers[0].self_attn, text.layers[0].mlp
    assert attn.qkv_weight is not None and mlp.gate_up_weight is not None
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()  # a view: no second copy
    x = torch.randn(5, attn.q_proj.in_features)
    fused = mlp(x)
    mlp.gate_up_weight = None
    assert torch.allclose(fused, mlp(x), atol=1e-5)
    ref = LLM(str(qwen2_vl_dir), device="cpu", enable_prefix_caching=False)
    prompt = ["<|im_start|>user\nthe quick brown fox"]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    out = ref.generate(prompt, greedy)[0].outputs[0].token_ids
    for layer in ref.runner.model.text.layers:  # the unfused path
        layer.self_attn.qkv_weight = layer.self_attn.qkv_bias = layer.mlp.gate_up_weight = None
    assert ref.generate(prompt, greedy)[0].outputs[0].token_ids == out


def test_a_page_shared_by_queries_is_hashed_once_per_call(llm, monkeypatch):
    """The queries of a page pass the same PIL object: one generate() call converts and hashes it
    once (a 1000x1400 page costs ~3-6 ms to hash); a later call hashes again, so a page edited in
    between is seen as new."""
    from docproc.models import processor

    calls = []
    real = processor.load_image
    monkeypatch.setattr(processor, "load_image", lambda obj, h=None: calls.append(h) or real(obj, h))
    a, b = page(31), page(32)
    reqs = [{"prompt": IMG + q, "multi_modal_data": {"image": [img]}}
            for img, q in ((a, "vendor"), (a, "total"), (b, "vendor"), (a, "date"))]
    sp = SamplingParams(max_tokens=3)
    first = [o.outputs[0].token_ids for o in llm.generate(reqs, sp)]
    assert len(calls) == 2
    a.paste((0, 0, 0), (0, 0, 40, 40))  # the page changes between calls
    second = llm.generate(reqs[:1] + reqs[2:3], sp)
    assert len(calls) == 4
    assert second[0].metrics.num_encoded_images == 1  # new pixels, new hash: encoded afresh
    assert second[1].metrics.num_encoded_images == 0  # the unchanged page: from the encoder cache
    fresh = [o.outputs[0].token_ids for o in llm.generate([dict(r, multi_modal_data={"image": [page(31)]})
                                                           if i in (0, 1, 3) else r for i, r in enumerate(reqs)], sp)]
    assert fresh == first  # memoised answers equal those of separately loaded images


def test_prefetched_image_preprocessing_gives_the_inline_answers(qwen2_vl_dir):
    """Pages preprocessed ahead on threads (the default beside a GPU) encode to the same tokens as
    pages preprocessed inline: several pages, one shared by two queries, a queue longer than the
    running set, and an unreadable image that fails alone."""
    prompts = [{"prompt": IMG + f"Field {i}?", "multi_modal_data": {"image": [page(40 + i % 5, 100 + 8 * (i % 5))]}}
               for i in range(9)]
    prompts.insert(4, {"prompt": IMG + "broken", "multi_modal_data": {"image": [b"not an image"]}})
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = {}
    for workers in (0, 2):
        llm = LLM(str(qwen2_vl_dir), device="cpu", max_num_seqs=2, image_prefetch_workers=workers)
        outs[workers] = [(o.outputs[0].token_ids if o.outputs else None, o.error) for o in llm.generate(prompts, sp)]
        pf = llm.runner.prefetcher
        if workers:
            assert pf.num_prefetched >= 4 and pf.num_prefetched + pf.num_inline == 5  # five unique pages
            assert not pf._pending  # nothing left held after the call
        else:
            assert pf.num_prefetched == 0 and pf.num_inline == 5
        pf.close()
    assert outs[2] == outs[0]
    assert outs[0][4][1]  # the broken image failed alone, with its reason
    assert all(toks for i, (toks, _) in enumerate(outs[0]) if i != 4)


def test_a_queued_page_waits_only_for_preprocessing_under_way(qwen2_vl_dir):
    """Scheduler.ready as the engine sets it: a page whose preprocessing is under way on the
    prefetcher is not ready, one prepared or not started (a full prefetcher: prepared inline) is."""
    import threading

    from docproc.engine.stream import RequestStream

    llm = LLM(str(qwen2_vl_dir), device="cpu", image_prefetch_workers=1)
    pf, gate = llm.runner.prefetcher, threading.Event()
    compute = pf._compute
    pf._compute = lambda image: gate.wait(30) and compute(image)
    handle, = RequestStream(llm).add([{"prompt": IMG + "Total?", "multi_modal_data": {"image": [page(77)]}}],
                                     [SamplingParams(max_tokens=2)], ["q"])
    seq = handle.seqs[0]
    assert llm.scheduler.ready is not None and llm.scheduler.ready(seq)  # not started
    llm.prefetch_waiting()
    h = seq.images[0].content_hash
    assert pf.pending(h) and not llm.scheduler.ready(seq)  # under way
    gate.set()
    pf._pending[h].result()
    assert llm.scheduler.ready(seq)  # prepared
    pf.close()


def test_a_cancelled_requests_pages_leave_the_prefetcher_unless_another_needs_them(qwen2_vl_dir):
    """A client that goes away: its pages being prepared ahead are forgotten (their places free
    for others), except a page a request still queued needs; the rest answer as before."""
    import threading

    from docproc.engine.stream import RequestStream

    llm = LLM(str(qwen2_vl_dir), device="cpu", image_prefetch_workers=1)
    pf, gate = llm.runner.prefetcher, threading.Event()
    compute = pf._compute
    pf._compute = lambda image: gate.wait(30) and compute(image)
    stream = RequestStream(llm)
    a, b, c = stream.add([{"prompt": IMG + q, "multi_modal_data": {"image": [page(n)]}}
                          for q, n in (("Total?", 77), ("Date?", 78), ("Vendor?", 77))],
                         [SamplingParams(max_tokens=2)] * 3, ["a", "b", "c"])
    llm.prefetch_waiting()
    h77, h78 = a.seqs[0].images[0].content_hash, b.seqs[0].images[0].content_hash
    assert pf.pending(h77) and pf.pending(h78)
    stream.cancel(b)
    assert not pf.pending(h78) and pf.pending(h77)
    stream.cancel(a)
    assert pf.pending(h77)  # c still needs it
    gate.set()
    done = {}
    while stream.unfinished:
        done.update(stream.step())
    assert done["a"].outputs[0].finish_reason == done["b"].outputs[0].finish_reason == "abort"
    assert len(done["c"].outputs[0].token_ids) == 2
    assert not pf._pending
    pf.close()


def test_image_prefetch_workers_is_checked():
    from docproc.config import EngineConfig

    with pytest.raises(ValueError, match="image_prefetch_workers"):
        EngineConfig(model="x", image_prefetch_workers=-1)


def test_a_dropped_engine_frees_its_memory_without_the_garbage_collector(qwen2_vl_dir):
    """No reference cycle through the engine (its step helpers hold it weakly, the vision tower's
    attention is a subclass, not a bound method on each module): dropping the last reference
    frees the weights and the KV pool at once, so a second engine in the same process (a GPU's
    memory budget is measured at start) sees the memory back."""
    import gc
    import weakref

    from PIL import Image

    llm = LLM(str(qwen2_vl_dir), device="cpu", speculative_model=str(qwen2_vl_dir), num_speculative_tokens=2)
    page = Image.new("RGB", (64, 48), "white")
    llm.generate([{"prompt": "<|vision_start|><|image_pad|><|vision_end|>total?", "multi_modal_data": {"image": [page]}}],
                 SamplingParams(max_tokens=4, ignore_eos=True))
    refs = [weakref.ref(x) for x in (llm, llm.runner, llm.runner.kv_cache, llm.speculator.runner,
                                     llm.runner.model.vision)]
    enabled = gc.isenabled()
    gc.disable()
    try:
        del llm
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        if enabled:
            gc.enable()


def test_the_vision_cache_is_bounded_by_bytes_as_well_as_entries():
    """Least recently used outputs go once the cache holds more bytes than its bound (or more
    entries), the one just put always stays, and replacing a key counts its bytes once."""
    import torch

    from docproc.engine.encoder_cache import EncoderCache

    cache = EncoderCache(max_entries=10, max_bytes=3 * 400)
    for i in range(4):
        cache.put(("fp", str(i)), torch.zeros(100))  # 400 bytes each
    assert [k for _, k in cache._entries] == ["1", "2", "3"] and cache.nbytes == 1200
    assert cache.get(("fp", "1")) is not None  # now the most recently used
    cache.put(("fp", "big"), torch.zeros(1000))  # over the bound alone: stays, the rest goes
    assert [k for _, k in cache._entries] == ["big"] and cache.nbytes == 4000
    cache.put(("fp", "big"), torch.zeros(10))
    assert cache.nbytes == 40 and len(cache) == 1
    few = EncoderCache(max_entries=2)
    for i in range(3):
        few.put(("fp", str(i)), torch.zeros(1))
    assert [k for _, k in few._entries] == ["1", "2"] and few.stats.num_evictions == 1

"""FP8 language-model weights: both checkpoint layouts and quantization at load against
transformers on the dequantized weights (CPU, float32: weight-only reference semantics), the
layouts docproc refuses, random weights from config.json alone, and the CUDA products against
the reference."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from docproc import LLM, SamplingParams
from docproc.models.quant import Fp8Weight, quantize
from fixtures.checkpoints import to_fp8
from test_parity import check_against_hf, hf_model, requests, run_engine


@pytest.mark.parametrize("group", [128, 48, 384])
def test_a_share_of_an_fp8_weight_keeps_its_values(group):
    """share_scales: the rows or the columns of a block-wise (or per-channel: group = K) weight
    that a tensor-parallel rank holds dequantize to exactly those rows or columns of the whole
    weight, also where a share starts inside a group (72B's down projection at two ranks starts
    at column 14,784 of its 128-column blocks: regrouped by 64 here too)."""
    from docproc.models.quant import share_scales

    g = torch.Generator().manual_seed(5)
    n, k = 96, 384
    codes = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    whole = Fp8Weight(codes, torch.rand(n, -(-k // group), generator=g) + 0.1, group)
    want = whole.dequantize()
    for lo, hi in [(0, 192), (192, 384), (0, 96), (96, 192), (288, 384), (64, 320)]:
        scale, gr = share_scales(whole.scale, group, cols=(lo, hi))
        share = Fp8Weight(codes[:, lo:hi].contiguous(), scale, gr)
        assert torch.equal(share.dequantize(), want[:, lo:hi]), (lo, hi)
        if group == k:  # per output channel: one scale a row, the share's whole width its group
            assert gr == hi - lo
        elif (lo, hi) == (192, 384):
            assert gr == {128: 64, 48: 48}[group]  # 192 is inside a 128-column group, at a 48-column one
    scale, gr = share_scales(whole.scale, group, rows=(32, 64))
    assert torch.equal(Fp8Weight(codes[32:64].contiguous(), scale, gr).dequantize(), want[32:64])


@pytest.mark.parametrize("layout,block,model", [("compressed-tensors", None, "qwen2_vl_dir"),
                                                ("block", (16, 32), "qwen2_vl_dir"),
                                                ("block", (16, 32), "qwen3_vl_dir")])  # Qwen3-VL's official layout
def test_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(request, tmp_path, layout, block, model):
    src = request.getfixturevalue(model)
    fp8 = to_fp8(src, tmp_path / "fp8", layout, block=block or (128, 128), dequantized=tmp_path / "deq")
    llm = LLM(str(fp8), device="cpu")
    attn = llm.runner.model.text.layers[0].self_attn
    assert isinstance(attn.qkv_weight, Fp8Weight) and isinstance(llm.runner.model.text.layers[1].mlp.down_weight,
                                                                 Fp8Weight)
    assert attn.q_proj.weight is None  # no float copy of a quantized product
    assert llm.cache_info()["weights_fp8"] == ("compressed-tensors" if layout == "compressed-tensors" else "fp8")
    reqs = requests()
    outs, logits = run_engine(llm, reqs)
    check_against_hf(llm, hf_model(tmp_path / "deq"), reqs, outs, logits)


@pytest.mark.slow
def test_quantization_at_load_matches_transformers_on_the_quantized_weights(qwen2_vl_dir, tmp_path):
    """quantization="fp8" on a float checkpoint: per-output-channel codes; transformers runs on
    exactly those weights (written dequantized), the engine's tokens equal its greedy ones. The
    quantized products hold at most 0.55x the bytes of bf16."""
    llm = LLM(str(qwen2_vl_dir), device="cpu", quantization="fp8")
    text = llm.runner.model.text
    deq = tmp_path / "deq"
    shutil.copytree(qwen2_vl_dir, deq)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(deq / "model.safetensors"))
    fp8_bytes = bf16_bytes = 0
    for key in list(tensors):
        module, _, leaf = key.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj") and "visual" not in key:
            q = quantize(tensors[key])
            tensors[key] = q.dequantize(torch.float32)
            fp8_bytes += q.nbytes
            bf16_bytes += 2 * tensors[key].numel()
    save_file(tensors, str(deq / "model.safetensors"))
    held = sum(w.nbytes for layer in text.layers for w in (layer.self_attn.qkv_weight, layer.self_attn.o_weight,
                                                           layer.mlp.gate_up_weight, layer.mlp.down_weight))
    assert held == fp8_bytes and held <= 0.55 * bf16_bytes, (held, bf16_bytes)
    # and nothing else holds a product's weight (the per-module FP8 weights are dropped once stacked)
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in text.parameters()}
    assert llm.cache_info()["weight_bytes"] == sum(params.values()) + held
    assert llm.cache_info()["weights_fp8"] == "online"
    assert llm.cache_info()["weight_bytes"] < LLM(str(qwen2_vl_dir), device="cpu").cache_info()["weight_bytes"]
    reqs = requests()[:3]
    outs, logits = run_engine(llm, reqs)
    check_against_hf(llm, hf_model(deq), reqs, outs, logits)
    assert llm.model_fingerprint()["text"] != LLM(str(qwen2_vl_dir), device="cpu").model_fingerprint()["text"]


@pytest.mark.parametrize("change,message", [
    (lambda q: q.update(quant_method="awq"), "quant_method 'awq'"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
     "static activation scales are not supported"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group"), "per channel or per tensor"),
    (lambda q: q.update(quant_method="fp8", weight_block_size=None), "without weight_block_size"),
])
def test_fp8_layouts_docproc_cannot_read_fail_with_one_clear_error(qwen2_vl_dir, tmp_path, change, message):
    from docproc.models.loader import CheckpointError

    fp8 = to_fp8(qwen2_vl_dir, tmp_path / "fp8", "compressed-tensors")
    cfg = json.loads((fp8 / "config.json").read_text())
    change(cfg["quantization_config"])
    (fp8 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        LLM(str(fp8), device="cpu")


def test_compressed_tensors_details(qwen2_vl_dir, tmp_path):
    """Weight-only checkpoints (no input_activations) keep weight-only products everywhere;
    all-zero zero points (symmetric) load, others are refused; e5m2 codes and FP8 KV scales are
    refused by name."""
    from safetensors.torch import load_file, save_file

    from docproc.models.loader import CheckpointError

    fp8 = to_fp8(qwen2_vl_dir, tmp_path / "fp8", "compressed-tensors")
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = None
    (fp8 / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(fp8 / "model.safetensors"))
    zp = next(k for k in t if k.endswith("layers.0.mlp.up_proj.weight_scale")).replace("weight_scale", "weight_zero_point")
    t[zp] = torch.zeros(t[zp.replace("weight_zero_point", "weight_scale")].shape, dtype=torch.int8)
    save_file(t, str(fp8 / "model.safetensors"))
    llm = LLM(str(fp8), device="cpu")
    assert llm.runner.model.text.layers[0].mlp.gate_up_weight.act_quant is False
    t[zp] = torch.ones_like(t[zp])
    save_file(t, str(fp8 / "model.safetensors"))
    with pytest.raises(CheckpointError, match="non-zero zero points"):
        LLM(str(fp8), device="cpu")
    del t[zp]
    key = next(k for k in t if k.endswith("layers.0.mlp.up_proj.weight"))
    t[key] = t[key].float().to(torch.float8_e5m2)
    save_file(t, str(fp8 / "model.safetensors"))
    with pytest.raises(CheckpointError, match="float8_e5m2"):
        LLM(str(fp8), device="cpu")
    t[key] = t[key].float().to(torch.float8_e4m3fn)
    scale_key = key + "_scale"  # a per-tensor scale stored 0-d, as some checkpoints do
    t[scale_key] = t[scale_key].float().amax().reshape(())
    save_file(t, str(fp8 / "model.safetensors"))
    up = LLM(str(fp8), device="cpu").runner.model.text.layers[0].mlp.gate_up_weight
    half = up.shape[0] // 2
    assert torch.equal(up.scale[half:], t[scale_key].expand(half, 1))
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float"}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="kv_cache_scheme"):
        LLM(str(fp8), device="cpu")


def test_fp8_weight_without_its_scale_is_named(qwen2_vl_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from docproc.models.loader import CheckpointError

    fp8 = to_fp8(qwen2_vl_dir, tmp_path / "fp8", "compressed-tensors")
    t = load_file(str(fp8 / "model.safetensors"))
    key = next(k for k in t if k.endswith("layers.1.mlp.up_proj.weight_scale"))
    del t[key]
    save_file(t, str(fp8 / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.up_proj lacks its scale \(weight_scale\)"):
        LLM(str(fp8), device="cpu")


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.slow
def test_dummy_weights_from_the_config_alone(qwen2_vl_dir, tmp_path, quantization):
    """A config.json (with the tokenizer and preprocessor files) is enough; the draw is the same for
    the same seed, and a block-wise config draws block-wise weights."""
    folder = tmp_path / "config_only"
    shutil.copytree(qwen2_vl_dir, folder)
    (folder / "model.safetensors").unlink()
    llm = LLM(str(folder), device="cpu", load_format="dummy", quantization=quantization)
    out = llm.generate(["<|im_start|>user\nhello"], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 6
    again = LLM(str(folder), device="cpu", load_format="dummy", quantization=quantization)
    assert again.model_fingerprint() == llm.model_fingerprint()  # the same draw for the same seed
    with pytest.raises(Exception, match="no weights found"):
        LLM(str(folder), device="cpu")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 32]}
    (folder / "config.json").write_text(json.dumps(cfg))
    block = LLM(str(folder), device="cpu", load_format="dummy")
    w = block.runner.model.text.layers[0].mlp.gate_up_weight
    assert isinstance(w, Fp8Weight) and w.group == 32 and w.scale.shape[1] > 1
    assert block.model_fingerprint() != llm.model_fingerprint()


# ---- the CUDA products ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("n,k,group,gated,bias", [(4608, 3584, None, False, True), (3584, 18944, None, True, False),
                                                  (37888, 3584, 128, False, False), (3584, 18944, 128, True, False),
                                                  (1000, 4000, None, False, False), (1000, 4000, 128, False, True)])
def test_fp8_one_row_kernel_matches_the_reference(n, k, group, gated, bias):
    from kernels.fp8 import fp8_linear_ref, gemv_fp8
    from docproc.models.quant import from_blocks

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    if group is None:
        q = quantize(w)
    else:
        tiles = -(-n // 128), -(-k // group)
        scale_inv = torch.rand(tiles, device="cuda", generator=g) * 1e-4 + 1e-5
        codes = (torch.randn(n, k, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        q = from_blocks(codes, scale_inv, (128, group))
    x = torch.randn(1, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g) if bias else None
    y = gemv_fp8(x, q.data, q.scale, q.group, b, gated=gated).float()
    ref = fp8_linear_ref(x.float(), q.data, q.scale, q.group, None if b is None else b.float(), gated=gated)
    err = ((y - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, err


@pytest.mark.gpu
def test_fp8_tensor_core_product_matches_the_reference_within_activation_rounding():
    from kernels.fp8 import fp8_linear_ref, scaled_mm

    g = torch.Generator(device="cuda").manual_seed(1)
    w = quantize(torch.randn(4608, 3584, device="cuda", generator=g) * 0.02)
    x = torch.randn(37, 3584, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(4608, device="cuda", dtype=torch.bfloat16, generator=g)
    y = scaled_mm(x, w.data, w.scale, b).float()
    ref = fp8_linear_ref(x.float(), w.data, w.scale, w.group, b.float())
    rel = ((y - ref).norm() / ref.norm()).item()
    assert rel < 0.05, rel  # the input's per-token FP8 rounding: ~2-3% relative for random data


def test_block_scales_in_the_layout_cublas_reads():
    """A 128 x 128 block-wise weight's scales as cuBLAS's block scaling takes them: (G rounded up
    to 4, N / 128), column-major, padding 1; None where rows do not fall in whole blocks of one
    scale (a stack whose part has 64 rows, 200 rows)."""
    from docproc.models.quant import quantize_blocks, stack
    from kernels.fp8 import cublas_block_scales

    g = torch.Generator().manual_seed(2)
    w = quantize_blocks(torch.randn(256, 384, generator=g), (128, 128))  # G = 3 column groups
    t = cublas_block_scales(w.scale, 256, 384)
    assert t.shape == (4, 2) and t.stride() == (1, 4)
    assert torch.equal(t[:3], w.scale[::128].t()) and torch.equal(t[3], torch.ones(2))
    odd = quantize_blocks(torch.randn(64, 384, generator=g), (128, 128))
    both = stack([odd, w, odd])  # 384 rows, but rows 0-127 hold two parts' scales
    assert both.shape[0] % 128 == 0 and cublas_block_scales(both.scale, 384, 384) is None
    assert cublas_block_scales(stack([w, w]).scale, 512, 384) is not None
    assert cublas_block_scales(quantize_blocks(torch.randn(200, 384, generator=g), (128, 128)).scale, 200, 384) is None
    ragged = quantize_blocks(torch.randn(256, 300, generator=g), (128, 128))  # K not whole blocks
    assert cublas_block_scales(ragged.scale, 256, 300) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_fp8_activation_quantizers_match_their_references_on_cuda():
    """The one-kernel activation quantizers (per row; per row and 128 columns) give the torch
    references' codes and scales exactly: rows of zeros, a ragged K, 72B's down projection width."""
    from kernels.fp8 import quantize_groups, quantize_groups_ref, quantize_rows, quantize_rows_fast

    g = torch.Generator(device="cuda").manual_seed(4)
    for m, k in ((1, 3584), (37, 18944), (300, 8192), (5, 200), (3, 29568)):
        x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16) * 3
        if m > 1:
            x[0] = 0  # a row of zeros: scale 1
        for (q1, s1), (q2, s2) in ((quantize_rows(x), quantize_rows_fast(x)),
                                   (quantize_groups_ref(x, 128), quantize_groups(x, 128))):
            assert torch.equal(s1, s2), (m, k)
            assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)), (m, k)
        # into the buffers a product hands it: column-major scales, codes with padding rows
        gq = -(-k // 128)
        out = torch.zeros(m + 5, k, device="cuda", dtype=torch.float8_e4m3fn)
        scales = torch.ones(gq, m + 5, device="cuda").t()
        quantize_groups(x, 128, scales, out=out)
        q1, s1 = quantize_groups_ref(x, 128)
        assert torch.equal(out[:m].view(torch.uint8), q1.view(torch.uint8)) and torch.equal(scales[:m], s1)
        assert not out[m:].view(torch.uint8).any() and bool((scales[m:] == 1).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_fp8_block_product_on_cuda_matches_its_quantized_reference():
    """Past ROWS_MAX rows a 128 x 128 block-wise weight's product runs on the FP8 tensor cores with
    per-(token, 128 columns) activation scales (cuBLAS's block scaling): equal, to float32
    accumulation order, to the float product of the dequantized codes on both sides, and within
    the activations' FP8 rounding of the weight-only reference. Row counts not a multiple of 16
    (padded) and a bias."""
    from docproc.models.quant import fp8_linear, quantize_blocks
    from kernels.fp8 import dequantize_ref, fp8_linear_ref, quantize_groups_ref, tensor_core_fp8

    if not tensor_core_fp8(torch.device("cuda", torch.cuda.current_device()))[1]:
        pytest.skip("no block-scaled FP8 product here (a Hopper GPU and a torch with F.scaled_mm)")
    g = torch.Generator(device="cuda").manual_seed(6)
    # 28 and 148 column groups, and 72B's down projection (231: the weight's scales padded to 232)
    for n, k in ((4608, 3584), (3584, 18944), (256, 29568)):
        q = quantize_blocks(torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02, (128, 128))
        assert q.blocks is not None
        b = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16)
        for rows in (17, 100, 256):
            x = torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16)
            got = fp8_linear(x, q, b).float()
            xq, sx = quantize_groups_ref(x, 128)
            xd = dequantize_ref(xq, sx, 128, torch.float32)
            want = xd @ q.dequantize(torch.float32).t() + b.float()
            assert ((got - want).norm() / want.norm()).item() < 5e-3, (n, k, rows)
            weight_only = fp8_linear_ref(x.float(), q.data, q.scale, q.group, b.float())
            assert ((got - weight_only).norm() / weight_only.norm()).item() < 0.05


def _small_fp8_weight(n: int, k: int, blocks: bool, g: torch.Generator) -> Fp8Weight:
    """A small FP8 weight for the interpreter tests: per-row scales, or 128 x 128 blocks."""
    from docproc.models.quant import from_blocks

    if blocks:
        codes = (torch.randn(n, k, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        return from_blocks(codes, torch.rand(-(-n // 128), -(-k // 128), generator=g) * 1e-3 + 1e-4, (128, 128))
    return quantize(torch.randn(n, k, generator=g) * 0.02)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("blocks", [False, True])
def test_fp8_one_row_kernel_in_the_interpreter(gated, blocks):
    """The one-row FP8 kernel at small sizes under Triton's interpreter (the GPU test above takes
    the real shapes): per-row and per-(row, 128 columns) scales, plain and gated, a ragged K."""
    from kernels.fp8 import fp8_linear_ref, gemv_fp8

    if torch.cuda.is_available():
        pytest.skip("the interpreter runs on CPU tensors")
    g = torch.Generator().manual_seed(3)
    n, k = 40, 320
    q = _small_fp8_weight(n, k, blocks, g)
    x = torch.randn(1, 2 * k if gated else k, generator=g)
    bias = torch.randn(n, generator=g)
    y = gemv_fp8(x, q.data, q.scale, q.group, bias, gated=gated, config=(8, 256, 4))
    ref = fp8_linear_ref(x, q.data, q.scale, q.group, bias, gated=gated)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-6), (y - ref).abs().max()


@pytest.mark.parametrize("blocks", [False, True])
def test_fp8_few_row_kernel_in_the_interpreter(blocks):
    """The few-row FP8 kernel (verification windows) under Triton's interpreter: 2, 7 and 16 rows,
    per-row and per-(row, 128 columns) scales, a bias, a ragged K; weight-only, as the reference."""
    from kernels.fp8 import fp8_linear_ref, gemm_fp8_rows

    if torch.cuda.is_available():
        pytest.skip("the interpreter runs on CPU tensors")
    g = torch.Generator().manual_seed(5)
    n, k = 72, 320
    q = _small_fp8_weight(n, k, blocks, g)
    bias = torch.randn(n, generator=g)
    for rows in (2, 7, 16):
        x = torch.randn(rows, k, generator=g)
        want = fp8_linear_ref(x, q.data, q.scale, q.group, bias)
        got = gemm_fp8_rows(x, q.data, q.scale, q.group, bias, config=(32, 128, 4, 2))
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the default tiles (per-row scales: 256 columns, K = 320 ragged in them)
    x = torch.randn(7, k, generator=g)
    torch.testing.assert_close(gemm_fp8_rows(x, q.data, q.scale, q.group, bias),
                               fp8_linear_ref(x, q.data, q.scale, q.group, bias), rtol=1e-4, atol=1e-4)


def test_fp8_tensor_core_product_in_the_interpreter():
    """The Triton FP8 tensor-core product (decode batches past ROWS_MAX) under Triton's interpreter,
    on codes quantized by the torch references (the interpreter's own float-to-FP8 conversion
    rounds some values across a power of two wrongly; the GPU test checks the quantizers): per-row
    and block-wise scales, 17 rows in two 16-row tiles and 40 in one, K unsplit and split in 2 and
    3 (its partial sums added by the second kernel), a bias, a ragged K; equal to the float product
    of the dequantized codes on both sides to float32 summation order."""
    from kernels.fp8 import dequantize_ref, product_fp8_tc, quantize_groups_ref, quantize_rows

    if torch.cuda.is_available():
        pytest.skip("the interpreter runs on CPU tensors")
    g = torch.Generator().manual_seed(7)
    n, k = 72, 320
    for blocks in (False, True):
        q = _small_fp8_weight(n, k, blocks, g)
        bias = torch.randn(n, generator=g).to(torch.bfloat16)
        for rows, block_m, splits in ((17, 16, 1), (40, 64, 1), (40, 32, 3), (17, 16, 2)):
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            xq, sx = quantize_groups_ref(x, q.group) if blocks else quantize_rows(x)
            want = dequantize_ref(xq, sx, q.group, torch.float32) @ q.dequantize(torch.float32).t() + bias.float()
            got = product_fp8_tc(xq, sx, q.data, q.scale, q.group, bias, torch.float32,
                                 config=(block_m, 32, 128 if blocks else 64, 4, 2, splits))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("blocks", [False, True])
def test_fp8_tensor_core_product_on_cuda(blocks):
    """fp8_linear past ROWS_MAX on CUDA (the Triton tensor-core product up to TC_ROWS_MAX rows,
    cuBLAS's past it) against the float product of the dequantized codes on both sides, and
    within the activations' rounding of the weight-only reference: a decode batch's row counts
    (17-256, each tile shape), 7B's shapes, a bias, and 72B's down projection width (231 groups)."""
    from docproc.models.quant import fp8_linear, quantize_blocks
    from kernels.fp8 import (TC_ROWS_MAX, dequantize_ref, fp8_linear_ref, quantize_groups, quantize_rows_fast,
                             tc_warm_rows)

    g = torch.Generator(device="cuda").manual_seed(8)
    for n, k, bias in ((4608, 3584, True), (3584, 18944, False), (256, 29568, False)):
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        q = quantize_blocks(w, (128, 128)) if blocks else quantize(w)
        b = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16) if bias else None
        for rows in (*tc_warm_rows(), 100, TC_ROWS_MAX, TC_ROWS_MAX + 3):
            x = torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16)
            xq, sx = quantize_groups(x, 128) if blocks else quantize_rows_fast(x)
            want = dequantize_ref(xq, sx, 128 if blocks else k, torch.float32) @ q.dequantize(torch.float32).t()
            if b is not None:
                want += b.float()
            got = fp8_linear(x, q, b).float()
            assert ((got - want).norm() / want.norm()).item() < 5e-3, (n, k, rows)
            weight_only = fp8_linear_ref(x.float(), q.data, q.scale, q.group, None if b is None else b.float())
            assert ((got - weight_only).norm() / weight_only.norm()).item() < 0.05, (n, k, rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("blocks", [False, True])
def test_fp8_few_row_kernel_on_cuda(blocks):
    """fp8_linear for 2-16 rows on CUDA (the few-row kernel) against the weight-only reference, at
    a 7B layer's shapes."""
    from docproc.models.quant import fp8_linear, quantize_blocks
    from kernels.fp8 import fp8_linear_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k, bias in ((4608, 3584, True), (3584, 18944, False)):
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        q = quantize_blocks(w, (128, 128)) if blocks else quantize(w)
        b = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16) if bias else None
        for rows in (2, 5, 9, 16):
            x = torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16)
            want = fp8_linear_ref(x, q.data, q.scale, q.group, b).float()
            got = fp8_linear(x, q, b).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < 1e-2, (n, k, rows, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_fp8_products_of_a_tensor_parallel_share_on_cuda():
    """A rank's share of 72B's block-wise down projection (K = 29,568, 128-column blocks): at 4
    ranks rank 3 starts at column 22,176 (groups of 32), at 2 ranks rank 1 at 14,784 (of 64). The
    one-row (gated), few-row and many-row products on CUDA against the reference (past ROWS_MAX:
    the input's FP8 codes per group of the share, the Triton product on the tensor cores)."""
    from docproc.models.quant import fp8_linear, quantize_blocks, share_scales
    from kernels.fp8 import ROWS_MAX, dequantize_ref, fp8_linear_ref, quantize_groups

    g = torch.Generator(device="cuda").manual_seed(3)
    n, k = 1024, 29568
    whole = quantize_blocks(torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02, (128, 128))
    for ranks, rank, group in ((4, 3, 32), (2, 1, 64)):
        lo, hi = rank * k // ranks, (rank + 1) * k // ranks
        scale, gr = share_scales(whole.scale, whole.group, cols=(lo, hi))
        assert gr == group
        q = Fp8Weight(whole.data[:, lo:hi].contiguous(), scale, gr)
        for rows, gated in ((1, True), (1, False), (5, False), (37, False)):
            x = torch.randn(rows, 2 * (hi - lo) if gated else hi - lo, device="cuda", generator=g,
                            dtype=torch.bfloat16)
            if rows > ROWS_MAX:  # the tensor cores: the input quantized per row and group of the share
                xq, sx = quantize_groups(x, gr)
                xd = dequantize_ref(xq, sx, gr, torch.float32)
                want = xd @ dequantize_ref(whole.data[:, lo:hi], scale, gr, torch.float32).t()
            else:
                want = fp8_linear_ref(x, whole.data[:, lo:hi], scale, gr, gated=gated).float()
            got = fp8_linear(x, q, gated=gated).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < 1e-2, (ranks, rows, gated, err)

"""The vision tower's fused kernels (kernels/vision_fused.py) against their torch references, and
the encoder's fast attention path against transformers' own."""
import pytest
import torch

from kernels.vision_fused import quick_gelu, quick_gelu_ref, vision_rotary_qk, vision_rotary_qk_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rotary_inputs(n, heads, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(n, 3 * heads * d, generator=g) * 3).to(dtype)
    ang = torch.randn(n, d // 2, generator=g) * 5
    ang = torch.cat([ang, ang], -1)  # transformers' layout: the same angles on both halves
    return qkv.to(DEV), ang.cos().to(DEV), ang.sin().to(DEV)


@pytest.mark.parametrize("n,heads,d", [(7, 3, 20), (1, 16, 80), (33, 2, 8)])
def test_vision_rotary_equals_reference_float32(n, heads, d):
    """Same float32 products and sum, no fused multiply-add: bit for bit. The rotate_half
    partner of dim j is j +- d/2 inside its own head (d = 80: not a power of two)."""
    qkv, cos, sin = _rotary_inputs(n, heads, d, torch.float32)
    q, k = vision_rotary_qk(qkv, cos, sin, heads)
    qr, kr = vision_rotary_qk_ref(qkv, cos, sin, heads)
    assert q.shape == (n, heads, d) and q.is_contiguous() and k.is_contiguous()
    assert torch.equal(q, qr) and torch.equal(k, kr)
    # and the reference is transformers' own function
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    views = qkv.reshape(n, 3, heads, d).permute(1, 0, 2, 3).unbind(0)
    qh, kh = apply_rotary_pos_emb_vision(views[0], views[1], cos, sin)
    assert torch.equal(qh, qr) and torch.equal(kh, kr)


def test_quick_gelu_matches_reference_float32():
    x = torch.randn(9, 1000, generator=torch.Generator().manual_seed(1)).to(DEV) * 6
    y = quick_gelu(x)
    assert torch.allclose(y, quick_gelu_ref(x), rtol=1e-6, atol=1e-6)
    z = x.clone()
    assert quick_gelu(z, out=z) is z and torch.equal(z, y)  # in place


@pytest.mark.gpu
def test_vision_kernels_bf16_on_gpu():
    """On the device bf16 rounding is round-to-nearest-even as in torch (the interpreter truncates,
    so this runs on a GPU only): the rotation is bit for bit, QuickGELU within one bf16 unit."""
    qkv, cos, sin = _rotary_inputs(4836, 16, 80, torch.bfloat16, seed=2)
    q, k = vision_rotary_qk(qkv, cos.float(), sin.float(), 16)
    qr, kr = vision_rotary_qk_ref(qkv, cos.float(), sin.float(), 16)
    assert torch.equal(q, qr) and torch.equal(k, kr)
    x = (torch.randn(4836, 5120, device="cuda") * 4).to(torch.bfloat16)
    y, yr = quick_gelu(x).float(), quick_gelu_ref(x).float()
    ulp = yr.abs().clamp_min(1e-30) * 2.0 ** -7
    assert ((y - yr).abs() <= ulp).all()
    assert (y != yr).float().mean() < 1e-3


def _encode_both(folder, device, dtype):
    """The tower's fused path (forced onto CPU tensors under Triton's interpreter), its reference
    path, and transformers' tower on the same weights, over two images of different sizes."""
    from PIL import Image
    from transformers import Qwen2VLForConditionalGeneration

    from docproc.models.loader import load_model
    from docproc.models.processor import Processor

    model = load_model(folder, torch.device(device), dtype)
    proc = Processor(folder, model.hf_config)
    g = torch.Generator().manual_seed(3)
    imgs = [Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy())
            for h, w in ((112, 84), (56, 140))]
    pv, grid = proc.pixel_values(imgs)
    vision = model.vision
    pv = pv.to(device)
    vision.force_fused = device == "cpu"
    fast, fast_trunk = vision.encode(pv, grid)
    vision.force_fused = False
    vision.fast_attention = False  # the reference rotation
    ref, ref_trunk = vision.encode(pv, grid)
    vision.fast_attention = True
    hf = Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=dtype).model.visual.to(device)
    with torch.no_grad():
        out = hf(pv, grid_thw=grid.to(device))
    return fast, ref, fast_trunk, ref_trunk, out


@pytest.mark.parametrize("bias", [False, True])
def test_the_patch_embedding_as_one_product_equals_the_convolution(bias):
    """The fast path's patch embedding (one product with the Conv3d kernel flattened) gives the
    convolution's float32 values, also with a bias (Qwen3-VL's) and patches of two frames."""
    from docproc.models.vision import PatchEmbed

    torch.manual_seed(0)
    pe = PatchEmbed(14, 2, 3, 64, bias=bias)
    x = torch.randn(37, 3 * 2 * 14 * 14)
    fast, conv = pe(x, fused=True), pe(x, fused=False)
    assert fast.shape == conv.shape == (37, 64)
    assert torch.allclose(fast, conv, rtol=1e-5, atol=1e-5), (fast - conv).abs().max()
    flipped = pe(x.view(37, 3, 2, 14, 14).flip(-1).reshape(37, -1), fused=True)  # the layout matters
    assert not torch.allclose(flipped, conv, rtol=1e-2, atol=1e-2)


def test_a_long_span_is_an_attention_call_of_its_own():
    """Equal spans share an attention call (Qwen2.5-VL's windows) unless they are long: a page's
    span is a call of its own, so that SDPA's cuDNN backend plans one shape per page size, not
    one per number of equal pages a step encodes, and a page's output is the one it gets alone."""
    from docproc.models.vision import SPAN_ALONE, EncodeCall, VisionAttention

    call = EncodeCall([64, 64, 64, SPAN_ALONE, SPAN_ALONE, 64], fused=False, sdpa_backends=None)
    assert call.runs == [(0, 64, 3), (192, SPAN_ALONE, 1), (192 + SPAN_ALONE, SPAN_ALONE, 1),
                         (192 + 2 * SPAN_ALONE, 64, 1)]
    torch.manual_seed(0)
    attn = VisionAttention(16, 2).eval()
    n = SPAN_ALONE
    x = torch.randn(2 * n, 16)
    ang = torch.randn(2 * n, 4)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    with torch.no_grad():
        both = attn(x, cos, sin, EncodeCall([n, n], False, None))
        alone = [attn(x[i * n:(i + 1) * n], cos[i * n:(i + 1) * n], sin[i * n:(i + 1) * n], EncodeCall([n], False, None))
                 for i in range(2)]
    assert torch.equal(both, torch.cat(alone))


@pytest.mark.slow
def test_fast_vision_attention_equals_transformers_on_cpu(qwen2_vl_dir):
    """The fused path gives the reference path's float32 output, and both transformers', on two
    images of different sizes in one call."""
    fast, ref, fast_trunk, ref_trunk, hf = _encode_both(qwen2_vl_dir, "cpu", torch.float32)
    assert len(fast) == len(ref) == 2
    for a, b in zip(fast + fast_trunk, ref + ref_trunk):  # (float32 sums in another order: the
        # trunk's outputs reach ~100 here, their differences ~1e-6 of that)
        scale = b.abs().max().item()
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5 * max(1.0, scale)), (a - b).abs().max()
    assert torch.equal(torch.cat(ref), hf.pooler_output) and torch.equal(torch.cat(ref_trunk), hf.last_hidden_state)


@pytest.mark.gpu
def test_fast_vision_attention_matches_transformers_on_gpu(qwen2_vl_dir):
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        # float32 in float32: cuDNN's convolutions (the reference's patch embedding, transformers')
        # take TF32 by default, 6e-4 off here, where the fast path's product does not
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            fast, ref, _, _, hf = _encode_both(qwen2_vl_dir, "cuda", dtype)
        for a, b in zip([torch.cat(fast), torch.cat(ref)], [torch.cat(ref), hf.pooler_output]):
            assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol), (dtype, (a - b).abs().max())


"""A profiling target for Nsight Compute: the Gluon FP4 decode kernel (kernels/fp4_gluon.py) at the
7B geometry (28 query heads, 4 KV heads, head_dim 128, block 16), the engine's split count, over a
pool of random bytes (scales and slot indices kept valid). Three launches; profile the third:

    ncu --kernel-name regex:fp4_decode --launch-skip 2 --launch-count 1 \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        python scripts/ncu_fp4_decode.py SLOTS BATCH CONTEXT        # e.g. 2 32 32768

SLOTS: key outlier slots, 2 (the default pool) or 0."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernels.fp4 import FP4PagedLayer  # noqa: E402
from kernels.attention_plan import default_num_splits, plan_tiles  # noqa: E402
from kernels.paged_attention import paged_attention_tuned  # noqa: E402


def main() -> None:
    slots, batch, ctx = (int(a) for a in sys.argv[1:4])
    hq, hkv, d, bs = 28, 4, 128, 16
    nb = batch * ctx // bs + 1
    layer = FP4PagedLayer(nb, bs, hkv, d, "cuda", num_outliers=2)
    layer.pages.random_(0, 100)  # E4M3 scales below 0x7F (finite), slot indices below 128, finite fp16 values
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(nb - 1, generator=g).add_(1).view(batch, -1).tolist()
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    n_w = default_num_splits(batch, ctx, torch.cuda.get_device_properties(0).multi_processor_count, hkv, wide=True)
    plan = plan_tiles(list(range(batch + 1)), [ctx] * batch, tables, hq // hkv, "cuda", num_splits=n_w,
                      num_kv_heads=hkv)
    k, v = layer.kernel_views("k"), layer.kernel_views("v")
    if not slots:
        k = (k[0], k[1], k[2][..., :0], k[3][..., :0], k[4])
    for _ in range(3):
        paged_attention_tuned(q, plan, d ** -0.5, fp4_k=k, fp4_v=v, fp4_gluon=True)
    torch.cuda.synchronize()
    print(f"3 launches, {n_w} splits")


if __name__ == "__main__":
    main()

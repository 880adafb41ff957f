"""ncu target: one FP4 Gluon decode call at 7B, batch 32, 32k keys (engine split), slots 2 or 0."""
import sys, torch
sys.path.insert(0, ".")
from kernels.fp4 import FP4PagedLayer
from kernels.paged_attention import paged_attention, plan_tiles, default_num_splits
slots = int(sys.argv[1]); batch = int(sys.argv[2]); ctx = int(sys.argv[3])
hq, hkv, d, bs = 28, 4, 128, 16
nb = batch * ctx // bs + 1
layer = FP4PagedLayer(nb, bs, hkv, d, "cuda", num_outliers=2, num_value_outliers=0)
layer.pages.random_(0, 100)  # valid-ish bytes: scales < 0x7F, idx < 128
g = torch.Generator().manual_seed(0)
tables = torch.randperm(nb - 1, generator=g).add_(1).view(batch, -1).tolist()
q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
n_w = default_num_splits(batch, ctx, 132, hkv, wide=True)
plan = plan_tiles(list(range(batch + 1)), [ctx] * batch, tables, hq // hkv, "cuda", num_splits=n_w, num_kv_heads=hkv)
k = layer.kernel_views("k"); v = layer.kernel_views("v")
if not slots:
    k = (k[0], k[1], k[2][..., :0], k[3][..., :0], k[4])
for _ in range(3):
    paged_attention(q, plan, d ** -0.5, fp4_k=k, fp4_v=v, fp4_gluon=True)
torch.cuda.synchronize()
print("ok", n_w)

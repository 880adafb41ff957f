"""Engine configuration: dataclasses that check themselves. Derived runtime values (block count,
EOS ids, resolved dtypes) live on the runner, not here."""
from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp4")
MODEL_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float")
DEVICES = ("auto", "cpu", "cuda")


def parse_spec_k(value: int | str) -> tuple[int, bool]:
    """num_speculative_tokens: a number (fixed K) or "auto" (adaptive, K up to 8)."""
    if isinstance(value, str):
        if value == "auto":
            return 8, True
        if not value.isdigit():
            raise ValueError(f"num_speculative_tokens must be a number or 'auto', got {value!r}")
        value = int(value)
    if not 1 <= value <= 15:
        raise ValueError(f"num_speculative_tokens must be between 1 and 15, got {value}")
    return value, False


@dataclass
class CacheConfig:
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    # Bytes for the KV pool when there is no GPU to size it from (CPU), or an explicit override.
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None  # exact pool size; overrides both of the above (tests)
    encoder_cache_entries: int = 256  # vision outputs kept, keyed by (vision fingerprint, image hash)
    # and at most this many bytes of them (a Qwen3-VL-8B page's outputs with DeepStack: ~40 MiB);
    # on CUDA the KV pool is sized with this much of the card left to them (at most an eighth of
    # what the pool would have had)
    encoder_cache_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported: pick one of {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.encoder_cache_entries < 1:
            raise ValueError(f"encoder_cache_entries must be >= 1, got {self.encoder_cache_entries}")
        if self.encoder_cache_bytes < 0:
            raise ValueError(f"encoder_cache_bytes must be >= 0, got {self.encoder_cache_bytes}")


@dataclass
class EngineConfig:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None
    seed: int = 0
    cache: CacheConfig | None = None
    enforce_eager: bool = False  # no CUDA graphs for decode/verify steps (debugging, profiling)
    # threads that preprocess page images ahead of their vision encode (None: up to 8 beside a GPU,
    # none on a CPU engine; 0: inline)
    image_prefetch_workers: int | None = None
    # CUDA kernel choices of this engine (kernels/options.py: handed to its model and attention
    # backend; off for comparisons and profiles): one-row weight products in kernels/gemv.py (else
    # cuBLAS), programmatic dependent launch on sm_90+ (kernels/pdl.py), the Gluon FP4 decode kernel
    # (else the Triton one)
    one_row_kernels: bool = True
    pdl: bool = True
    fp4_gluon: bool = True
    # answers independent of the batch (kernels/options.py KernelOptions.batch_invariant; slower):
    # a request gives the tokens it gives alone, whatever runs beside it and however its steps are cut
    batch_invariant: bool = False
    # FP8 weights for the language model: None (the checkpoint's own layout, FP8 or float) or
    # "fp8" (a float checkpoint quantized at load, per output channel; models/quant.py)
    quantization: str | None = None
    # "auto": the folder's safetensors; "dummy": random weights from config.json alone (benchmarks)
    load_format: str = "auto"
    # the language model split over this many ranks (processes), one GPU each on CUDA
    tensor_parallel_size: int = 1
    # where the weights' digests are kept for the next load of the same files (models/digests.py):
    # "auto" ($XDG_CACHE_HOME/docproc/weight-digests, ~/.cache when unset), a folder, or None (none)
    weight_digest_cache: str | None = "auto"

    def __post_init__(self) -> None:
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"tensor_parallel_size must be from 1 to 64, got {self.tensor_parallel_size}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization {self.quantization!r} is not supported: pick fp8 (or none)")
        if self.weight_digest_cache == "":
            raise ValueError("weight_digest_cache must be 'auto', a folder or None, not an empty string")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise ValueError("batch_invariant needs tensor_parallel_size 1: the ranks' all-reduce sums in an order "
                             "that follows its size")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format {self.load_format!r} is not supported: pick auto or dummy")
        if self.cache is None:
            self.cache = CacheConfig()
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device {self.device!r} is not supported: pick auto, cpu, cuda or cuda:N")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported: pick auto, bfloat16, float16 or float32")
        if self.max_num_batched_tokens < self.cache.block_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least block_size "
                f"({self.cache.block_size})"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.image_prefetch_workers is not None and self.image_prefetch_workers < 0:
            raise ValueError(f"image_prefetch_workers must be >= 0, got {self.image_prefetch_workers}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


SPEC_DRAFT_VISION = ("auto", "own", "none")


@dataclass
class SpecConfig:
    """Speculative decoding: the draft model and how many tokens it proposes per step.
    num_speculative_tokens is a number (a fixed K, 1..15) or "auto" (the adaptive policy picks K
    in 0..8 every step). draft_vision: "own" (the draft encodes pages with its vision tower),
    "none" (the draft reads the text only) or "auto" (own, sharing the target's vision trunk
    where both towers have the same one)."""

    model: str
    num_speculative_tokens: int | str = 4
    draft_vision: str = "auto"

    def __post_init__(self) -> None:

        self.k_max, self.adaptive = parse_spec_k(self.num_speculative_tokens)
        if self.draft_vision not in SPEC_DRAFT_VISION:
            raise ValueError(f"draft_vision must be auto, own or none, got {self.draft_vision!r}")


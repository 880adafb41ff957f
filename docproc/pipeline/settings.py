"""What a run is asked to do (RunSettings, checked whole before anything loads) and what it
counts as it goes (RunTotals)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def bundled_model(name: str) -> Path:
    """The folder of the bundled pair's "target" or "draft" (docproc/assets/models)."""
    return Path(__file__).parent.parent / "assets" / "models" / name


@dataclass
class RunSettings:
    inputs: list[str]
    out: str
    model: str
    queries: str | None = None
    device: str = "auto"
    kv_cache: str = "auto"
    dpi: int = 120
    max_pages: int | None = None
    formats: tuple[str, ...] = ("json", "parquet")
    force: bool = False
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    batch_pages: int | None = None  # pages rendered ahead of the engine and not yet answered (default: 128 with a GPU, 32 on a CPU)
    load_format: str = "auto"  # "dummy": random weights from config.json (benchmarks; a hidden option)
    render_workers: int | None = None  # render processes (default: on a GPU a quarter of the cores, 1 to 4; on a CPU 0: a thread)
    max_image_tokens: int = 16384  # per prompt; more pages are split into windows
    seed: int = 0
    draft: str | None = None  # speculative decoding: the draft model folder
    spec_k: str = "auto"  # a number or "auto"
    draft_vision: str = "auto"
    anchor_text: bool = False  # put each PDF page's text layer (with coordinates) in the prompt
    enforce_eager: bool = False  # no CUDA graphs (debugging, profiling)
    batch_invariant: bool = False  # answers independent of the batch (kernels/options.py; slower)
    quantization: str | None = None  # "fp8": the model's language weights quantized to FP8 at load
    tensor_parallel_size: int = 1  # the model's language weights split over this many GPUs (processes)
    debug: bool = False  # tracebacks of documents' unexpected errors on stderr
    ray: bool = False  # data-parallel over engine actors on a Ray cluster (pipeline/distributed.py)
    ray_address: str | None = None  # an existing cluster ("auto", "ray://host:10001", host:6379); else a local one
    data_parallel_size: int | None = None  # engine actors (one GPU each on CUDA); default: the cluster's GPUs, or 1

    def __post_init__(self) -> None:
        from docproc.pipeline.schema import OUTPUT_FORMATS

        if set(self.formats) - set(OUTPUT_FORMATS) or not self.formats:
            raise ValueError(f"--format takes {', '.join(OUTPUT_FORMATS)} (comma-separated), got {','.join(self.formats)}")
        if not self.inputs:
            raise ValueError("give at least one input file or folder")
        if self.dpi < 10 or self.dpi > 1200:
            raise ValueError(f"--dpi must be between 10 and 1200, got {self.dpi}")
        if self.max_pages is not None and self.max_pages < 1:
            raise ValueError(f"--max-pages must be >= 1, got {self.max_pages}")
        if self.draft_vision not in ("auto", "own", "none"):
            raise ValueError(f"--draft-vision must be auto, own or none, got {self.draft_vision}")
        if self.spec_k != "auto" and not (self.spec_k.isdigit() and 1 <= int(self.spec_k) <= 15):
            raise ValueError(f"--spec-k must be a number from 1 to 15 or auto, got {self.spec_k}")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise ValueError("--batch-invariant needs one GPU (--tensor-parallel-size 1): the ranks' all-reduce sums "
                             "in an order that follows its size")
        if self.kv_cache not in ("auto", "bf16", "fp16", "fp32", "fp4"):
            raise ValueError(f"--kv-cache must be auto, bf16, fp16, fp32 or fp4, got {self.kv_cache}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"--quantization must be fp8 (or left out), got {self.quantization}")
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"--tensor-parallel-size must be from 1 to 64, got {self.tensor_parallel_size}")
        if self.device not in ("auto", "cpu", "cuda") and not (
                self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device}")
        if not 16 <= self.max_num_batched_tokens <= 1 << 20:
            raise ValueError(f"--max-num-batched-tokens must be from 16 to {1 << 20}, got {self.max_num_batched_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.batch_pages is not None and self.batch_pages < 1:
            raise ValueError(f"--batch-pages must be >= 1, got {self.batch_pages}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"--load-format must be auto or dummy, got {self.load_format}")
        if self.render_workers is not None and not 0 <= self.render_workers <= 64:
            raise ValueError(f"--render-workers must be from 0 to 64, got {self.render_workers}")
        if not self.ray and (self.ray_address is not None or self.data_parallel_size is not None):
            raise ValueError("--ray-address and --data-parallel-size go with --ray")
        if self.data_parallel_size is not None and not 1 <= self.data_parallel_size <= 4096:
            raise ValueError(f"--data-parallel-size must be from 1 to 4096, got {self.data_parallel_size}")
        if self.ray and self.device.startswith("cuda:"):
            raise ValueError("--device cuda:N does not go with --ray: Ray gives each engine actor its own GPU "
                             "(--device cuda or auto)")
        if self.max_image_tokens < 64:
            raise ValueError(f"max_image_tokens must be >= 64, got {self.max_image_tokens}")


@dataclass
class RunTotals:
    files: int = 0
    documents: int = 0  # documents processed this run
    ok: int = 0
    partial: int = 0
    errors: int = 0
    skipped: int = 0  # unsupported files, links out of the root, broken links, special files
    already_done: int = 0  # same path, hash and configuration as an earlier run
    moved: int = 0  # renamed files: their rows moved to the new path, the model not run
    removed: int = 0  # documents whose files are gone: their rows left results.parquet
    pages: int = 0
    unique_pages: int = 0
    blank_pages: int = 0  # pages with nothing on them: their windows answered empty without the engine
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0
    draft_verifications: int = 0

"""What the pipeline may ask about the device without holding an engine, and without importing
torch (a run with nothing to do must not pay its 2-3 s import)."""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import sys
from pathlib import Path


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def _torch_build() -> str | None:
    """A hash of torch's generated version.py (its version and the CUDA and HIP versions it was
    built for), found without importing torch; None without torch."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        text = _read(os.path.join(folder, "version.py"))
        if text is not None:
            return hashlib.sha256(text.encode()).hexdigest()[:16]
    return None


def cuda_environment() -> dict:
    """Everything torch.cuda.is_available() depends on, read without importing torch: the torch
    build (a CPU build never sees CUDA), the NVIDIA kernel driver's version, the GPUs it lists
    (/proc/driver/nvidia/gpus, one entry per board) and the device nodes this process can open
    (/dev/nvidia0.., what a container is given), CUDA_VISIBLE_DEVICES ("" or "-1" hide every GPU),
    and /dev/kfd and HIP's or ROCR's list for a ROCm build. Equal values give the same answer from is_available(), so a
    key that holds this dict changes whenever `auto` choices (device, dtype, KV format) could;
    a value that changes without changing the answer (a driver update) costs one model load to
    compute the same fingerprint, never a wrong one."""
    return {
        "torch": _torch_build(),
        "driver": _read("/proc/driver/nvidia/version"),
        "gpus": sorted(os.listdir("/proc/driver/nvidia/gpus")) if os.path.isdir("/proc/driver/nvidia/gpus") else [],
        "nodes": sorted(os.path.basename(p) for p in glob.glob("/dev/nvidia[0-9]*")),
        "visible": [os.environ.get(v) for v in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")],
        "rocm": os.path.exists("/dev/kfd"),
    }


def gpu_nodes_visible() -> bool:
    """Whether this process can see a GPU's device node (torch not imported): what `auto` would
    likely pick a GPU from."""
    env = cuda_environment()
    hidden = any(v is not None and v.strip() in ("", "-1") for v in env["visible"])
    return bool(env["nodes"] or env["rocm"]) and not hidden


def peak_gpu_memory() -> int | None:
    """The most GPU memory this process has allocated (bytes); None without CUDA. A process that
    never imported torch allocated none: torch is not imported to say so."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "cuda"):  # not imported, or its import was cut short
        return None
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def gpu_alloc_retries() -> int | None:
    """How often the GPU's caching allocator found the card full, returned every cached block and
    tried again (each waits for the device): nonzero is a run short of memory; None where this
    process did not use CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "cuda") or not torch.cuda.is_initialized():  # (a CPU run on a CUDA host)
        return None
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


def peak_host_memory() -> int:
    """The most resident host memory this process has held (bytes). On Linux the kernel's
    high-water mark of this program (VmHWM): getrusage's ru_maxrss keeps the peak of the process
    before it exec'd this program, so a run started from a parent holding 18 GB read 18 GB.
    Elsewhere ru_maxrss (bytes on macOS, KiB on other systems)."""
    status = _read("/proc/self/status")
    for line in (status or "").splitlines():
        if line.startswith("VmHWM:"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                break
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024

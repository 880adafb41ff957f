"""Loading local Hugging Face checkpoint folders of Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dense).

Accepts both key namings: published checkpoints (`visual.*`, `model.layers.*`, `lm_head.*`) and
what today's save_pretrained writes (`model.visual.*`, `model.language_model.*`); single or sharded
safetensors; tied embeddings; bf16/fp16/fp32 weights, and FP8 language-model weights in the
compressed-tensors and block-wise layouts (models/quant.py). Never pickle, never remote code.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from docproc.errors import ModelUnavailable
from docproc.models.digests import DigestCache, identity
from docproc.models.hf_config import QWEN3_MROPE_SECTION, qwen2_5_vl_config, qwen2_vl_config, qwen3_vl_config
from docproc.models.quant import (FP8, LINEAR_NAMES, LOAD_FORMATS, Fp8Scheme, Fp8Weight, UnsupportedQuantization,
                                  block_scales, channel_scales, quantize, quantize_blocks, resolve_scheme,
                                  share_scales)
from docproc.models.qwen2_vl import Qwen2VLTextModel, TextConfig
from docproc.models.rope import MRotaryEmbedding
from docproc.models.tokenizer_files import special_files
from docproc.models.vision import VisionEncoder

SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


class CheckpointError(ModelUnavailable, ValueError):
    """The folder is not a checkpoint docproc can load; the message says what is missing."""


def check_folder(folder: str | Path) -> Path:
    """The folder, if it exists and holds a config.json; else CheckpointError saying which."""
    folder = Path(folder)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise CheckpointError(f"model folder {folder} {what}: pass a local checkpoint folder "
                              f"(docproc never downloads models)")
    odd = special_files(folder)
    if odd is not None:
        raise CheckpointError(f"{folder} {odd}")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} is not a Hugging Face checkpoint: config.json is missing")
    return folder


def read_config(folder: str | Path):
    folder = check_folder(folder)
    cfg_path = folder / "config.json"
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from None
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        what = " (a mixture-of-experts model: docproc runs the dense Qwen3-VL models)" \
            if model_type == "qwen3_vl_moe" else ""
        raise CheckpointError(
            f"{folder}: model_type {model_type!r} is not supported{what}; docproc loads "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
        )
    reader = {"qwen2_vl": qwen2_vl_config, "qwen2_5_vl": qwen2_5_vl_config, "qwen3_vl": qwen3_vl_config}[model_type]
    try:  # docproc/models/hf_config.py (why our own: its docstring)
        return reader(raw)
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{folder}: {e}") from None


def text_config(hf_config) -> TextConfig:
    tc = getattr(hf_config, "text_config", None) or hf_config
    rope = dict(getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise CheckpointError(f"rope_type {rope_type!r} is not supported (only plain M-RoPE)")
    if getattr(tc, "use_sliding_window", False):
        raise CheckpointError("sliding-window attention checkpoints are not supported")
    theta = rope.get("rope_theta", getattr(tc, "rope_theta", 1000000.0))
    tie = bool(getattr(hf_config, "tie_word_embeddings", False) or getattr(tc, "tie_word_embeddings", False))
    qwen3 = hf_config.model_type == "qwen3_vl"
    return TextConfig(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=tc.num_hidden_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads or tc.num_attention_heads,
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=float(theta),
        mrope_section=list(rope.get("mrope_section") or (QWEN3_MROPE_SECTION if qwen3 else [16, 24, 24])),
        tie_word_embeddings=tie,
        max_position_embeddings=tc.max_position_embeddings,
        **(dict(head_size=tc.head_dim, attention_bias=bool(tc.attention_bias), qk_norm=True, mrope_interleaved=True,
                deepstack_layers=len(hf_config.vision_config.deepstack_visual_indexes))
           if qwen3 else {}),
    )


def weight_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(f"{folder}: shards listed in {index.name} are missing: {', '.join(missing)}")
        return [folder / s for s in shards]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    odd = [f.name for f in files if not f.is_file()]  # a folder, a FIFO (opening one waits for a writer)
    if odd:
        what = "is not a regular file" if len(odd) == 1 else "are not regular files"
        raise CheckpointError(f"{folder}: {', '.join(odd)} {what}")
    if files:
        return files
    if list(folder.glob("*.bin")) or list(folder.glob("*.pt")):
        raise CheckpointError(
            f"{folder} holds only pickle weights (.bin/.pt), which docproc never loads: convert them to safetensors"
        )
    raise CheckpointError(f"{folder}: no weights found (model.safetensors or a sharded index)")


def canonical_name(name: str) -> tuple[str, str] | None:
    """Map a checkpoint key to (component, parameter name) for either naming."""
    for prefix in ("model.visual.", "visual."):
        if name.startswith(prefix):
            return "vision", name[len(prefix):]
    if name.startswith("model.language_model."):
        return "text", name[len("model.language_model."):]
    if name.startswith("lm_head."):
        return "text", name
    if name.startswith("model."):
        return "text", name[len("model."):]
    return None


@dataclass
class LoadedModel:
    hf_config: object
    text: Qwen2VLTextModel
    vision: VisionEncoder
    vision_fingerprint: str  # trunk + merger weights; keys the encoder cache
    vision_trunk_fingerprint: str  # trunk only (a draft with the same trunk can share its output)
    text_fingerprint: str
    quant_method: str | None = None  # FP8 language weights: "compressed-tensors", "fp8" (block-wise) or "online"


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # (a per-tensor scale may be 0-d)


def _raw_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def quant_scheme(folder: str | Path, quantization: str | None) -> Fp8Scheme | None:
    """The FP8 scheme a load of this folder uses (CheckpointError for one docproc cannot read)."""
    try:
        return resolve_scheme(_raw_config(check_folder(folder)), quantization)
    except UnsupportedQuantization as e:
        raise CheckpointError(f"{folder}: {e}") from None


def load_model(folder: str | Path, device: torch.device, dtype: torch.dtype, quantization: str | None = None,
               load_format: str = "auto", seed: int = 0, tp_rank: int = 0, tp_size: int = 1,
               tp_group=None, tp_sync=None, digest_cache: Path | None = None) -> LoadedModel:
    """Build the text model and vision tower and fill them from the folder's safetensors
    (load_format "auto") or with random weights from config.json alone ("dummy": benchmarks at
    sizes whose checkpoints the disk cannot hold). With an FP8 scheme (the checkpoint's, or
    quantization="fp8" for a float checkpoint) the language model's products hold FP8 weights and
    their float parameters are never allocated. With tp_size > 1 the language model holds rank
    tp_rank's share (Megatron's split: q/k/v and gate/up by rows, o and down by columns, the
    vocabulary by rows), read as slices of the checkpoint's tensors, FP8 codes with the scales of
    their rows and columns (models/quant.share_scales); the vision tower is loaded on rank 0 only
    (the other ranks get its image embeddings with each step). Quantization at load then takes
    each row's scale over the whole row: the ranks of a row-parallel product (o, down) agree on
    it over tp_group, so a rank's codes are the one-rank model's. That collective comes after
    tp_sync(), which every rank calls once its share is read (rank 0's waits for the others and
    names a rank that failed), so that no rank waits in it for one that will never come.
    digest_cache: the folder where the digests of tensors read straight from a file are kept for
    the next load of the same file (models/digests.py), or None."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r}: pick one of {', '.join(LOAD_FORMATS)}")
    scheme = quant_scheme(folder, quantization)
    hf_config = read_config(folder)
    cfg = text_config(hf_config)
    if tp_size > 1:
        cfg.tp_size, cfg.tp_rank = tp_size, tp_rank
        cfg.check_split()

    with torch.device("meta"):
        text = Qwen2VLTextModel(cfg)
    fp8_modules: dict[str, torch.nn.Linear] = {}
    if scheme is not None:
        for name, mod in text.named_modules():
            if name.rsplit(".", 1)[-1] in LINEAR_NAMES:
                mod.weight = None  # never allocated in the model dtype: the loader sets loaded_weight
                fp8_modules[name] = mod
    text = materialize(text, device, dtype)
    text.rotary = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved).to(device)
    vision = build_vision(hf_config, device if tp_rank == 0 else torch.device("meta"), dtype)
    pending: list = []  # quantization at load of row-parallel shares: their rows' maxima agree over the ranks
    if load_format == "dummy":
        digests = _fill_random(text, vision, fp8_modules, scheme, seed, device, dtype,
                               (Path(folder) / "config.json").read_bytes() + f"|tp:{tp_rank}/{tp_size}".encode())
    else:
        digests = _fill_from_files(folder, text, vision, fp8_modules, scheme, device, dtype, cfg, pending,
                                   DigestCache(digest_cache))
    if tp_sync is not None:
        tp_sync()
    if pending:
        _quantize_shares(pending, tp_group)
    text.fuse_projections()
    text.eval()
    vision.eval()
    fp = {k: _combine(d) for k, d in digests.items()}
    vision_fp = _combine({"trunk": fp["trunk"], "merger": fp["merger"]})
    return LoadedModel(hf_config, text, vision, vision_fp, fp["trunk"], fp["text"],
                       scheme.method if scheme is not None else None)


def build_vision(hf_config, device: torch.device, dtype: torch.dtype) -> VisionEncoder:
    """The vision tower with uninitialised weights (the loader fills them): built on the meta
    device and given memory on `device`."""
    with torch.device("meta"):
        tower = VisionEncoder(hf_config)
    return materialize(tower, device, dtype)


def materialize(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A module built on the meta device given uninitialised memory on `device`, its floating
    tensors in `dtype` (what `module.to_empty(device=device).to(dtype)` gives, a tensor shared
    between modules still shared), each tensor allocated once, in its final dtype: to_empty
    allocates the dtype the module was built in first (float32: twice bf16's bytes, 30 GB for a
    7B model) and goes through torch's Python reference of empty_like, whose first call imports
    sympy (seconds of a run's start)."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
        return made[id(t)]

    with torch.no_grad():
        for m in module.modules():
            for name, p in m._parameters.items():
                if p is not None:
                    new = empty(p)
                    if not isinstance(new, torch.nn.Parameter):
                        new = made[id(p)] = torch.nn.Parameter(new, requires_grad=p.requires_grad)
                    m._parameters[name] = new
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = empty(b)
    return module


class _Hasher:
    """The weights' SHA-256 digests (the model fingerprint), computed on a pool of threads while
    the loading thread copies the tensors to the device (hashlib releases the GIL: single-threaded,
    hashing 15 GB of 7B weights took longer than reading and copying them). At most `window`
    tensors wait at once, so slices made for the hash are not all held together."""

    def __init__(self, window: int = 64, cache: DigestCache | None = None) -> None:
        self.pool = ThreadPoolExecutor(max_workers=max(1, min(8, (os.cpu_count() or 1))),
                                       thread_name_prefix="docproc-hash")
        self.window = window
        self.pending: deque[tuple[dict, str, Future]] = deque()
        self.cache = cache if cache is not None else DigestCache(None)
        self.known: dict[str, str] = {}  # the open file's digests from an earlier load (models/digests.py)
        self.ranges: dict[str, str | Future] = {}  # the open file's ranges hashed or taken from `known`

    def open_file(self, path: Path, fd: int) -> None:
        self.opened, self.opened_at = identity(fd), time.time_ns()
        self.known, self.ranges = self.cache.known(path, fd), {}

    def close_file(self, path: Path, fd: int) -> None:
        """The open file's tensors all read and hashed: its digests kept for a later load (if any
        were computed now)."""
        ranges, self.ranges = self.ranges, {}
        if any(isinstance(v, Future) for v in ranges.values()):
            self.cache.remember(path, fd, self.opened, self.opened_at,
                                {k: v if isinstance(v, str) else v.result() for k, v in ranges.items()})

    def add(self, into: dict, name: str, *tensors: torch.Tensor) -> None:
        while len(self.pending) >= self.window:
            self._settle()
        with _signals_held():
            self.pending.append((into, name, self.pool.submit(_sha256, tensors)))

    def _settle(self) -> None:
        into, name, fut = self.pending.popleft()
        into[name] = fut.result()

    def finish(self) -> None:
        try:
            while self.pending:
                self._settle()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)


    def wait(self) -> None:
        """Every digest submitted so far computed (or failed: finish() raises it), through a
        signal (_wait_through): the pool reads the file this guards until it closes."""
        _wait_through([fut for _, _, fut in self.pending])

    def add_range(self, into: dict, name: str, path: Path, fd: int, offset: int, nbytes: int) -> None:
        """A tensor's digest from its bytes in the file (read again by the pool's thread: the
        tensor itself went from the file to the device without a host copy to hash)."""
        key = f"{offset}:{nbytes}"
        if key in self.known:
            into[name] = self.ranges[key] = self.known[key]
            return
        while len(self.pending) >= self.window:
            self._settle()
        with _signals_held():
            fut = self.pool.submit(_sha256_range, path, fd, offset, nbytes)
            self.pending.append((into, name, fut))
        self.ranges[key] = fut


def _wait_through(futures: list[Future]) -> None:
    """Wait for the futures, also when a signal's exception (KeyboardInterrupt, RunInterrupted)
    comes meanwhile: it is raised once they are done, so no thread still reads a file that the
    exception would close."""
    interrupted = None
    while True:
        try:
            wait(futures)
            break
        except BaseException as e:  # noqa: BLE001 -- a signal's exception: raised once the threads are done
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM held back (on the main thread, where Python runs their handlers) until
    the block ends: a read or hash submitted to a pool is in its pending list before a signal's
    exception can stop the load, so the waits before a file closes know of every thread reading it."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    was = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, was)


def _sha256(tensors: tuple[torch.Tensor, ...]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def _sha256_range(path: Path, fd: int, offset: int, nbytes: int) -> str:
    h = hashlib.sha256()
    end = offset + nbytes
    while offset < end:
        chunk = os.pread(fd, min(HASH_CHUNK, end - offset), offset)
        if not chunk:
            raise CheckpointError(f"{path} ended inside a tensor (at byte {offset}): was it changed while loading?")
        h.update(chunk)
        offset += len(chunk)
    return h.hexdigest()


DIRECT_READS = hasattr(os, "preadv") and hasattr(os, "pread")  # POSIX (elsewhere: through safetensors)
HASH_CHUNK = 16 << 20
STAGE_BYTES = 32 << 20  # each pinned buffer a CUDA load reads through (two per read thread)
READ_WORKERS = 4
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                      "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def tensor_layout(path: Path, fd: int) -> dict[str, tuple[torch.dtype | None, tuple[int, ...], int, int]]:
    """A safetensors file's tensors: name -> (dtype or None if docproc has no name for it, shape,
    byte offset in the file, byte length), from its header (8 bytes of length, then JSON)."""
    head = os.pread(fd, 8, 0)
    size = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 2 <= size <= 100 << 20:
        raise CheckpointError(f"{path} is not a safetensors file (its header length reads {size})")
    try:
        header = json.loads(os.pread(fd, size, 8))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON: {e}") from None
    base = 8 + size
    out = {}
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        try:
            begin, end = info["data_offsets"]
            out[name] = (SAFETENSORS_DTYPES.get(info["dtype"]), tuple(info["shape"]), base + begin, end - begin)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from None
    return out


class _Reader:
    """Tensors read from their file straight into their parameters, for tensors stored in the
    parameter's dtype and shape: on the host into the parameter's own memory; on CUDA (staged)
    in chunks of `stage_bytes` on `workers` threads, each reading into a pinned buffer of its own
    turn (two per thread) and queueing the buffer's copy to the device without waiting, while the
    loading thread goes on to the next tensors. Read through safetensors instead, a tensor is
    copied from the mapped file to a new host tensor first: a 7B run's process peaked at 17.6 GB
    that way, at 3.2 GB this way. One thread reading through two buffers read 15 GB in about 2.5 s
    of a 4.4 s load on an H100 host: reads from the page cache are a memory copy that one thread
    does not saturate. A staged read is finished once wait() returns."""

    def __init__(self, device: torch.device, stage_bytes: int = STAGE_BYTES, staged: bool | None = None,
                 workers: int = READ_WORKERS) -> None:
        self.cuda = device.type == "cuda"
        self.staged = self.cuda if staged is None else staged
        self.stage_bytes = stage_bytes
        self.workers = workers
        self.pool: ThreadPoolExecutor | None = None
        self.free: queue.SimpleQueue | None = None  # (pinned buffer, the event after its last copy or None)
        self.pending: list[Future] = []

    def read(self, path: Path, fd: int, offset: int, nbytes: int, p: torch.Tensor) -> None:
        dst = p.detach().view(-1).view(torch.uint8)
        if not self.staged:
            _pread_into(path, fd, memoryview(dst.numpy()), offset)
            return
        if self.pool is None:
            self.free = queue.SimpleQueue()
            for _ in range(2 * self.workers):
                self.free.put((torch.empty(self.stage_bytes, dtype=torch.uint8, pin_memory=self.cuda), None))
            self.pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="docproc-read")
        for pos in range(0, nbytes, self.stage_bytes):
            n = min(self.stage_bytes, nbytes - pos)
            with _signals_held():
                self.pending.append(self.pool.submit(self._chunk, path, fd, offset + pos, dst[pos: pos + n]))

    def _chunk(self, path: Path, fd: int, offset: int, dst: torch.Tensor) -> None:
        buf, copied = self.free.get()
        try:
            if copied is not None:
                copied.synchronize()  # its previous chunk has reached the device
                copied = None
            view = buf[: dst.numel()]
            _pread_into(path, fd, memoryview(view.numpy()), offset)
            dst.copy_(view, non_blocking=self.cuda)
            if self.cuda:
                copied = torch.cuda.Event()
                copied.record(torch.cuda.current_stream(dst.device))  # (the stream the copy went to)
        finally:
            self.free.put((buf, copied))

    def wait(self) -> None:
        """Every read queued so far done (the first failure raised), through a signal
        (_wait_through): the threads read the file whose descriptor this guards."""
        pending, self.pending = self.pending, []
        _wait_through(pending)
        for fut in pending:
            fut.result()

    def finish(self) -> None:
        try:
            self.wait()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True, cancel_futures=True)
                while not self.free.empty():
                    _, copied = self.free.get()
                    if copied is not None:
                        copied.synchronize()
                self.pool = self.free = None
                # the buffers' pinned memory back to the system, not kept cached (the call's name
                # differs between torch releases)
                empty = (getattr(torch._C, "_accelerator_emptyHostCache", None)
                         or getattr(torch._C, "_host_emptyCache", None))
                if self.cuda and empty is not None:
                    empty()


def _pread_into(path: Path, fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"{path} ended inside a tensor (at byte {offset + done}): was it changed while "
                                  f"loading?")
        done += n


def _fill_from_files(folder, text, vision, fp8_modules, scheme, device, dtype, cfg, pending: list,
                     digest_cache: DigestCache | None = None) -> dict:
    hasher = _Hasher(cache=digest_cache)
    try:
        digests = _fill_files(folder, text, vision, fp8_modules, scheme, device, dtype, cfg, pending, hasher)
    finally:
        hasher.finish()
    if scheme is not None and scheme.method == "online":
        digests["text"]["quantization"] = "fp8-per-channel"  # other weights than the checkpoint's
    return digests


def _fill_files(folder, text, vision, fp8_modules, scheme, device, dtype, cfg, pending: list,
                hasher: _Hasher) -> dict:
    files = weight_files(folder)
    reader = _Reader(device)
    try:
        return _fill_files_with(files, reader, folder, text, vision, fp8_modules, scheme, device, dtype, cfg,
                                pending, hasher)
    finally:
        reader.finish()


def _fill_files_with(files, reader: _Reader, folder, text, vision, fp8_modules, scheme, device, dtype, cfg,
                     pending: list, hasher: _Hasher) -> dict:
    from safetensors import SafetensorError, safe_open

    text_params = dict(text.named_parameters())
    vision_params = dict(vision.visual.named_parameters())
    loaded: set[tuple[str, str]] = set()
    digests: dict[str, dict[str, str]] = {"text": {}, "trunk": {}, "merger": {}}
    staged: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # FP8 weights waiting for their scale
    scale_key = scheme.scale_suffix if scheme is not None else None
    for f in files:
        try:
            with open(f, "rb") as raw, safe_open(str(f), framework="pt", device="cpu") as sf:
                fd = raw.fileno()
                opened, now = os.fstat(fd), os.stat(f)
                if (opened.st_dev, opened.st_ino) != (now.st_dev, now.st_ino):  # (safetensors opened it by name)
                    raise CheckpointError(f"{f} was replaced while it was being opened: load again")
                layout = tensor_layout(f, fd) if DIRECT_READS else {}
                hasher.open_file(f, fd)
                try:
                    _fill_file(f, sf, fd, layout, reader, folder, text_params, vision_params, fp8_modules, scheme,
                               device, dtype, cfg, pending, hasher, loaded, digests, staged)
                finally:
                    try:
                        reader.wait()  # (the reads of this file end before the file closes)
                    finally:
                        hasher.wait()
                hasher.close_file(f, fd)
        except SafetensorError as e:  # (its own messages name no file)
            raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from None
    for (comp, module), entry in staged.items():
        what = f"its scale ({scale_key})" if "weight" in entry else "its codes (weight)"
        raise CheckpointError(f"{folder}: FP8 weight {comp}:{module} lacks {what}")
    if ("text", "lm_head.weight") not in loaded and cfg.tie_word_embeddings:
        text.lm_head.weight = text.embed_tokens.weight
        loaded.add(("text", "lm_head.weight"))
    expected = [("text", n) for n in text_params] + [("text", m + ".weight") for m in fp8_modules] \
        + [("vision", n) for n in vision_params if cfg.tp_rank == 0]
    missing = [f"{c}:{n}" for c, n in expected if (c, n) not in loaded]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{folder}: weights missing from the checkpoint: {', '.join(missing[:5])}{more}")
    return digests


def _fill_file(path: Path, sf, fd: int, layout: dict, reader: _Reader, folder, text_params, vision_params,
               fp8_modules, scheme, device, dtype, cfg, pending: list, hasher: _Hasher, loaded: set, digests: dict,
               staged: dict) -> None:
    """One safetensors file's tensors into the parameters (an FP8 weight meets its scale in `staged`,
    from this file or an earlier one)."""
    scale_key = scheme.scale_suffix if scheme is not None else None
    for key in sf.keys():
        mapped = canonical_name(key)
        if mapped is None:
            if key.endswith("rotary_emb.inv_freq"):
                continue
            raise CheckpointError(f"{folder}: unexpected weight {key!r} (not a Qwen2-VL parameter)")
        comp, name = mapped
        if comp == "vision" and cfg.tp_rank > 0:
            continue  # the vision tower lives on rank 0
        params = text_params if comp == "text" else vision_params
        module, _, leaf = name.rpartition(".")
        if scheme is not None and leaf == "weight_zero_point":
            if sf.get_tensor(key).any():
                raise CheckpointError(f"{folder}: {key!r}: asymmetric weights (non-zero zero points) are "
                                      f"not supported (only symmetric FP8)")
            continue  # a symmetric checkpoint's all-zero zero points
        if scheme is not None and leaf in (scale_key, "input_scale"):
            if leaf != scale_key:
                raise CheckpointError(f"{folder}: {key!r}: static activation scales are not supported "
                                      f"(only dynamic per-token FP8 activations)")
            staged.setdefault((comp, module), {})["scale"] = sf.get_tensor(key)
        elif comp == "text" and module in fp8_modules and leaf == "weight":
            sl = sf.get_slice(key)  # this rank's share; the whole shape for its scales
            staged.setdefault((comp, module), {}).update(weight=_text_share(folder, cfg, name, sl),
                                                         shape=tuple(sl.get_shape()))
        elif scheme is not None and leaf == "weight" and sf.get_slice(key).get_dtype().startswith("F8"):
            staged.setdefault((comp, module), {})["weight"] = sf.get_tensor(key)  # dequantized below
        else:
            if name not in params:
                if name.endswith("inv_freq"):
                    continue
                raise CheckpointError(
                    f"{folder}: unexpected weight {key!r} (no parameter {name} in the {comp} model)")
            p = params[name]
            kind, shape, offset, nbytes = layout.get(key, (None, (), 0, 0))
            if (kind == p.dtype and shape == tuple(p.shape) and p.is_contiguous() and p.device.type in ("cpu", "cuda")
                    and (comp != "text" or cfg.tp_size == 1) and nbytes == p.numel() * p.element_size()):
                reader.read(path, fd, offset, nbytes, p)  # (the whole tensor, as stored)
                hasher.add_range(digests[_which(comp, name)], name, path, fd, offset, nbytes)
            else:
                t = _text_share(folder, cfg, name, sf.get_slice(key)) if comp == "text" else sf.get_tensor(key)
                _copy_param(folder, key, p, t)
                hasher.add(digests[_which(comp, name)], name, t)
            loaded.add((comp, name))
            continue
        entry = staged[(comp, module)]
        if "weight" in entry and ("scale" in entry or entry["weight"].dtype != torch.float8_e4m3fn):
            staged.pop((comp, module))
            _place(folder, comp, module, entry, text_params, vision_params, fp8_modules, scheme,
                   device, dtype, cfg, pending, digests, hasher)
            loaded.add((comp, module + ".weight"))


def _share_bounds(cfg: TextConfig, name: str) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """The rows or the columns of a language-model tensor that are this rank's (Megatron's split;
    (None, None): all of it, the norms' case)."""
    r, d = cfg.tp_rank, cfg.head_dim
    if ".q_proj." in name:
        return (r * cfg.heads * d, (r + 1) * cfg.heads * d), None
    if ".k_proj." in name or ".v_proj." in name:
        return (cfg.kv_head_start * d, (cfg.kv_head_start + cfg.kv_heads) * d), None
    if ".o_proj." in name:
        return None, (r * cfg.heads * d, (r + 1) * cfg.heads * d)
    if ".gate_proj." in name or ".up_proj." in name:
        return (r * cfg.intermediate, (r + 1) * cfg.intermediate), None
    if ".down_proj." in name:
        return None, (r * cfg.intermediate, (r + 1) * cfg.intermediate)
    return None, None


def _full_shape(cfg: TextConfig, name: str) -> tuple[int, ...] | None:
    """The shape the config gives a language-model tensor whole (None: a norm, checked on load)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    for part, shape in ((".q_proj.", (q, h)), (".k_proj.", (kv, h)), (".v_proj.", (kv, h)), (".o_proj.", (h, q)),
                        (".gate_proj.", (cfg.intermediate_size, h)), (".up_proj.", (cfg.intermediate_size, h)),
                        (".down_proj.", (h, cfg.intermediate_size))):
        if part in name:
            return shape if name.endswith(".weight") else shape[:1]
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return cfg.vocab_size, h
    return None


def _text_share(folder, cfg: TextConfig, name: str, sl) -> torch.Tensor:
    """This rank's part of a language-model tensor, read from a safetensors slice (or a tensor;
    all of it without tensor parallelism). Split, the whole tensor's shape is checked first: a
    rank's share alone could fit a tensor of another shape."""
    if cfg.tp_size == 1:
        return sl[:]
    shape = tuple(sl.shape) if isinstance(sl, torch.Tensor) else tuple(sl.get_shape())
    full = _full_shape(cfg, name)
    if full is not None and shape != full:
        raise CheckpointError(f"{folder}: weight {name!r} has shape {shape} but the config implies {full}")
    if name in ("embed_tokens.weight", "lm_head.weight"):
        r = cfg.tp_rank
        lo, hi = r * cfg.vocab, min((r + 1) * cfg.vocab, cfg.vocab_size)
        part = sl[lo:hi]
        if hi - lo < cfg.vocab:  # the last rank's padding rows: zeros
            part = torch.cat([part, part.new_zeros(cfg.vocab - (hi - lo), *part.shape[1:])])
        return part
    rows, cols = _share_bounds(cfg, name)
    if rows is not None:
        return sl[rows[0]: rows[1]]
    if cols is not None:
        return sl[:, cols[0]: cols[1]]
    return sl[:]  # norms: every rank holds them


def _quantize_shares(pending: list, tp_group) -> None:
    """Quantization at load of row-parallel shares (o, down): each row's scale is the maximum over
    the whole row, one all-reduce over the ranks for all of them (every rank holds the same
    products, in the same order), so that each rank's codes are the one-rank model's."""
    amax = torch.cat([t.abs().amax(dim=-1).float() for _, t in pending])
    torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    for (mod, t), row_amax in zip(pending, amax.split([t.shape[0] for _, t in pending])):
        mod.loaded_weight = quantize(t, row_amax[:, None])
    pending.clear()


def _which(comp: str, name: str) -> str:
    return "text" if comp == "text" else ("merger" if name.startswith("merger.") else "trunk")


def _copy_param(folder, key: str, p: torch.Tensor, t: torch.Tensor) -> None:
    if tuple(t.shape) != tuple(p.shape):
        raise CheckpointError(f"{folder}: weight {key!r} has shape {tuple(t.shape)} but the config implies "
                              f"{tuple(p.shape)}")
    with torch.no_grad():
        p.copy_(t.to(p.dtype))


def _place(folder, comp, module, entry, text_params, vision_params, fp8_modules, scheme, device, dtype, cfg,
           pending: list, digests, hasher: _Hasher) -> None:
    """One product's weight, from its codes and scale (or a float weight): an FP8 weight for the
    language model's products (this rank's share), dequantized into the parameter anywhere else."""
    w = entry["weight"]
    shape = entry.get("shape", tuple(w.shape))  # the whole weight's, where w is a rank's share
    rows, cols = _share_bounds(cfg, module + ".") if shape != tuple(w.shape) else (None, None)
    name = module + ".weight"
    if w.dtype in (torch.float8_e5m2, getattr(torch, "float8_e4m3fnuz", None), getattr(torch, "float8_e5m2fnuz", None)):
        raise CheckpointError(f"{folder}: weight {comp}:{name} is {str(w.dtype).removeprefix('torch.')}: docproc reads "
                              f"float8_e4m3fn weights only")
    hasher.add(digests[_which(comp, name)], name, w, *([entry["scale"]] if "scale" in entry else []))
    if w.dtype == torch.float8_e4m3fn:
        try:
            if scheme.method == "fp8":
                scale, group = block_scales(entry["scale"], shape, scheme.block), scheme.block[1]
            else:
                scale, group = channel_scales(entry["scale"], shape), shape[1]
        except UnsupportedQuantization as e:
            raise CheckpointError(f"{folder}: {comp}:{module}: {e}") from None
        q = Fp8Weight(w.view(FP8), *share_scales(scale, group, rows, cols))
    else:
        q = None
    mod = fp8_modules.get(module) if comp == "text" else None
    if mod is not None:
        if tuple(w.shape) != (mod.out_features, mod.in_features):
            raise CheckpointError(f"{folder}: weight {comp}:{name} has shape {tuple(w.shape)} but the config "
                                  f"implies {(mod.out_features, mod.in_features)}")
        if q is None:  # a float weight: quantized at load (online), else kept as the checkpoint has it
            t = w.to(device=device, dtype=dtype)
            if scheme.method != "online":
                mod.loaded_weight = t
                return
            if cols is not None:  # a share of each row: quantized once the ranks agree on each row's maximum
                pending.append((mod, t))
            else:
                mod.loaded_weight = quantize(t)
        else:
            mod.loaded_weight = Fp8Weight(q.data.to(device), q.scale.to(device), q.group, scheme.dynamic_activations)
        return
    params = text_params if comp == "text" else vision_params
    if name not in params:
        raise CheckpointError(f"{folder}: unexpected weight {comp}:{name}")
    t = q.dequantize(torch.float32) if q is not None else w
    _copy_param(folder, name, params[name], _text_share(folder, cfg, name, t) if comp == "text" else t)


def _fill_random(text, vision, fp8_modules, scheme, seed: int, device, dtype, config_bytes: bytes) -> dict:
    """load_format="dummy": normal(0, 0.02) weights (norm weights 1, every bias 0) drawn on the
    device; FP8 products quantized from such a draw one matrix at a time, in the scheme's layout
    (per channel, or block-wise for a block-wise config). The fingerprint names the config, the
    dtype, the seed and the layout."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    with torch.no_grad():
        for name, p in [*text.named_parameters(), *vision.named_parameters()]:
            if p.dim() == 1:
                is_norm = name.endswith(".weight") and ("norm" in name or "ln_q" in name)
                p.fill_(1.0 if is_norm else 0.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        for mod in fp8_modules.values():
            w = torch.empty(mod.out_features, mod.in_features, device=device, dtype=dtype).normal_(
                0.0, 0.02, generator=g)
            if scheme.method == "fp8":
                mod.loaded_weight = quantize_blocks(w, scheme.block)
            else:
                mod.loaded_weight = quantize(w)
            mod.loaded_weight.act_quant = scheme.dynamic_activations
            del w
    if text.cfg.tie_word_embeddings:
        text.lm_head.weight = text.embed_tokens.weight
    tag = hashlib.sha256(config_bytes + f"|dummy:{seed}:{dtype}:{scheme.method if scheme else 'float'}".encode()
                         ).hexdigest()
    return {"text": {"dummy": tag}, "trunk": {"dummy": tag}, "merger": {"dummy": tag}}


def text_weight_bytes(text: Qwen2VLTextModel) -> int:
    """Bytes the language model's weights take (each storage once: fused products are views of
    their parameters, a tied LM head is the embedding; FP8 weights: codes and scales)."""
    seen: set[int] = set()
    total = 0
    tensors = list(text.parameters())
    for mod in text.modules():  # the loader's per-module weights, where any are left
        w = getattr(mod, "loaded_weight", None)
        if isinstance(w, Fp8Weight):
            tensors += [w.data, w.scale]
        elif w is not None:
            tensors.append(w)
    for layer in text.layers:
        for w in (layer.self_attn.qkv_weight, layer.self_attn.o_weight, layer.mlp.gate_up_weight,
                  layer.mlp.down_weight):
            if isinstance(w, Fp8Weight):
                tensors += [w.data, w.scale]
            elif w is not None:
                tensors.append(w)
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _combine(digests: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}={digests[name]};".encode())
    return h.hexdigest()[:16]

"""Tensor parallelism: the target's language model split over ranks, one process each.

The user's process is rank 0: it holds the scheduler, the block manager, the sampler, the vision
tower and any draft, exactly as with one rank, plus its share of the language model and of every
layer's KV cache. The engine spawns ranks 1..N-1 (`torch.multiprocessing`, spawn), each loading
only its slices of the checkpoint (models/loader.py) and holding its share of the KV pool (the
same block ids as rank 0). Rank 0's model is wrapped so that every forward and every LM-head
call is first broadcast to the other ranks with its inputs (ids, positions, attention metadata,
image rows and their embeddings, encoded on rank 0): the ranks then run the same layers, whose
row-parallel products end in an all-reduce, and the vocabulary-parallel head ends in an
all-gather. Collectives are gloo on CPU and NCCL on CUDA.

The vision tower runs on rank 0 only: its output for a page is ~1,000 rows of the hidden size,
sent with the step that first reads it, and the prefix cache keys a page once; replicating the
tower would cost every rank its weights and every page N encodes, and splitting it, a collective
per vision layer for a model that is a few percent of a 72B target's work.

Faults: rank 0 checks that every rank is alive before each broadcast, and every collective has
a timeout; a rank that dies or hangs ends the engine with RankFailure (no hang), a device fault
that stops a `docproc run` with exit 4 (its finished documents kept), and the engine refuses
further work. Loading has no collective until every rank has read its share
(wait_loaded): a rank whose load fails records its error in the group's store, rank 0 raises
it and kills the ranks; if rank 0's own load fails, it kills them too.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from docproc.errors import DeviceUnavailable

COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a rank loading a large shard, or a stuck collective
START_TIMEOUT_S = 1800.0  # every rank loaded and joined (a 72B shard from a slow disk)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, hung or failed: the engine is down."""


class RankFailure(TensorParallelError, DeviceUnavailable):
    """A rank died or a collective broke after the engine started: its device failed, so the run
    stops (not each remaining request failing alone)."""


def check_split(config, hf_config) -> None:
    """ValueError (or CheckpointError) when the model cannot run split as asked."""
    from docproc.models.loader import quant_scheme, text_config

    tc = text_config(hf_config)
    tc.tp_size = config.tensor_parallel_size
    tc.check_split()
    quant_scheme(config.model, config.quantization)  # a layout docproc cannot read: before any rank starts
    if config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available()):
        base = int(config.device[5:]) if config.device.startswith("cuda:") else 0
        if base + tc.tp_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={tc.tp_size} from {config.device} needs GPUs {base} to "
                             f"{base + tc.tp_size - 1}; this machine has {torch.cuda.device_count()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class TensorParallelGroup:
    """Rank 0's handle on the other ranks: starts them, sends them each step, stops them."""

    def __init__(self, config, device: torch.device, runner_class) -> None:
        """runner_class: what each rank builds to hold its share (engine/model_runner.py's
        ModelRunner, passed down so that this module does not import the one that imports it)."""
        import torch.multiprocessing as mp

        self.size = config.tensor_parallel_size
        self.failed: str | None = None
        if dist.is_initialized():
            raise TensorParallelError("torch.distributed is already initialized in this process: another "
                                      "tensor-parallel engine is open (close it first: llm.close()), or the "
                                      "program uses its own process group, which docproc's ranks cannot share")
        port = _free_port()
        self.store = store = dist.TCPStore("127.0.0.1", port, self.size, is_master=True, wait_for_workers=False,
                                           timeout=timedelta(seconds=START_TIMEOUT_S))
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_rank_main, args=(rank, self.size, port, config, runner_class), daemon=True,
                                  name=f"docproc-tp{rank}") for rank in range(1, self.size)]
        for p in self.procs:
            p.start()
        # every rank has started (its imports done) before the group forms: a rank that dies on
        # the way is named at once instead of rank 0 waiting for it
        t0 = time.monotonic()
        while any(not store.check([f"started{r}"]) for r in range(1, self.size)):
            dead = [(r, p.exitcode) for r, p in enumerate(self.procs, start=1) if not p.is_alive()]
            if dead or time.monotonic() - t0 > START_TIMEOUT_S:
                for p in self.procs:
                    p.kill()
                why = (f"tensor-parallel rank {dead[0][0]} exited (code {dead[0][1]}) as it started"
                       if dead else "the tensor-parallel ranks did not start in time")
                raise TensorParallelError(f"{why}: a script that builds LLM(tensor_parallel_size=N) needs the "
                                          f"`if __name__ == \"__main__\":` guard (the ranks are spawned processes)")
            time.sleep(0.05)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(_backend(device), store=store, rank=0, world_size=self.size,
                                timeout=timedelta(seconds=START_TIMEOUT_S))
        self.group = dist.new_group(list(range(self.size)), timeout=COLLECTIVE_TIMEOUT)
        self.device = device

    def wait_loaded(self) -> None:
        """Rank 0 after its own load: wait until every rank has loaded its share (the loader's
        collectives come after this, so no rank waits in one for a rank that failed). A rank that
        failed or died is named with its error and the others are stopped."""
        t0 = time.monotonic()
        while True:
            for rank, p in enumerate(self.procs, start=1):
                failure = self._failure(rank)
                if failure is not None:
                    kind, message = failure
                    self.abort()
                    if kind == "CheckpointError":
                        from docproc.models.loader import CheckpointError

                        raise CheckpointError(message)
                    raise TensorParallelError(f"tensor-parallel rank {rank} failed to load its share: {kind}: "
                                              f"{message}")
                if not p.is_alive():
                    self.abort()
                    raise TensorParallelError(f"tensor-parallel rank {rank} exited (code {p.exitcode}) while "
                                              f"loading its share")
            if all(self.store.check([f"loaded{r}"]) for r in range(1, self.size)):
                return
            if time.monotonic() - t0 > START_TIMEOUT_S:
                self.abort()
                raise TensorParallelError(f"the tensor-parallel ranks did not load in {START_TIMEOUT_S:.0f} s")
            time.sleep(0.02)

    def _failure(self, rank: int) -> tuple[str, str] | None:
        """(exception type, message) a rank recorded as it failed (_rank_main), or None."""
        if not self.store.check([f"failed{rank}"]):
            return None
        kind, _, message = self.store.get(f"failed{rank}").decode().partition("\n")
        return kind, message

    def abort(self) -> None:
        """Stop the other ranks without a collective (rank 0 failed, or a rank did, while loading:
        the others may be in the middle of their load or waiting in a collective)."""
        self.failed = self.failed or "the engine failed to start"
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 -- best effort while failing
                pass

    # ---- steps -----------------------------------------------------------------------------
    def check(self) -> None:
        if self.failed is not None:
            raise RankFailure(self.failed)
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                failure = self._failure(rank)
                why = f" after {failure[0]}: {failure[1]}" if failure is not None else ""
                self.fail(f"tensor-parallel rank {rank} died (exit code {p.exitcode}){why}: the engine is down; "
                          f"check the GPUs (nvidia-smi) and start a new one")

    def fail(self, message: str) -> None:
        self.failed = message
        raise RankFailure(message)

    def send(self, *msg) -> None:
        """Broadcast one message to the other ranks (after checking they are alive)."""
        self.check()
        try:
            dist.broadcast_object_list([msg], src=0, group=self.group)
        except Exception as e:  # noqa: BLE001 -- a collective that broke: the engine is down
            self.fail(f"tensor-parallel broadcast failed ({type(e).__name__}: {e}): a rank died or hung")

    def collective(self, fn, *args):
        """Run a step's local work, whose collectives a dead rank breaks."""
        try:
            return fn(*args)
        except TensorParallelError:
            raise
        except RuntimeError as e:
            if "gloo" in str(e).lower() or "nccl" in str(e).lower() or "connection" in str(e).lower():
                self.check()
                self.fail(f"a tensor-parallel collective failed ({e}): a rank died or hung")
            raise

    def gather_fingerprints(self, own: str) -> list[str]:
        self.send("fingerprint")
        out = [None] * self.size
        dist.gather_object(own, out, dst=0, group=self.group)
        return out

    def close(self) -> None:
        if self.failed is None:
            try:
                self.send("exit")
            except TensorParallelError:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 -- best effort at shutdown
                pass


class ShardedText:
    """Rank 0's language model under tensor parallelism: the local shard, with each forward and
    LM-head call first sent to the other ranks. Everything else is the shard's."""

    def __init__(self, local, group: TensorParallelGroup) -> None:
        self.local = local
        self.group = group

    def __getattr__(self, name):
        return getattr(self.local, name)

    def __call__(self, ids, pos, kv_layers, meta, backend, rows=None, embeds=None):
        self.group.send("forward", ids.cpu(), pos.cpu(), _to_cpu(meta), None if rows is None else rows.cpu(),
                        None if embeds is None else embeds.cpu())
        return self.group.collective(self.local, ids, pos, kv_layers, meta, backend, rows, embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.group.send("logits", hidden.cpu())
        return self.group.collective(self.local.compute_logits, hidden)


def _to_cpu(meta):
    """The attention metadata with its tensors on the host (each rank puts them on its device),
    without rank 0's kernel plan (each rank's backend makes its own)."""
    meta = _map_tensors(meta, lambda t: t.cpu())
    return replace(meta, plan=None) if getattr(meta, "plan", None) is not None else meta


def _map_tensors(meta, fn):
    import dataclasses

    if meta is None or not dataclasses.is_dataclass(meta):
        return meta
    changes = {}
    for f in dataclasses.fields(meta):
        v = getattr(meta, f.name)
        if isinstance(v, torch.Tensor):
            changes[f.name] = fn(v)
    return replace(meta, **changes) if changes else meta


def _rank_main(rank: int, size: int, port: int, config, runner_class) -> None:
    """A tensor-parallel rank: load its share, then run what rank 0 sends until it says exit."""
    device_name = config.device
    if device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available()):
        base = int(device_name[5:]) if device_name.startswith("cuda:") else 0
        torch.cuda.set_device(base + rank)
        device_name = f"cuda:{base + rank}"
    device = torch.device(device_name if device_name != "auto" else "cpu")
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timedelta(seconds=START_TIMEOUT_S))
    store.set(f"started{rank}", "1")
    dist.init_process_group(_backend(device), store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=START_TIMEOUT_S))
    group = dist.new_group(list(range(size)), timeout=COLLECTIVE_TIMEOUT)
    try:
        runner = runner_class(replace(config, device=device_name), allocate=False, tp_rank=rank, tp_group=group,
                             tp_sync=lambda: store.set(f"loaded{rank}", "1"))
    except BaseException as e:  # rank 0 names it (wait_loaded), then stops this process
        store.set(f"failed{rank}", f"{type(e).__name__}\n{e}")
        raise
    text = runner.model.text
    hidden = None
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        kind, *args = box[0]
        if kind == "forward":
            ids, pos, meta, rows, embeds = args
            dev = runner.device
            meta = _map_tensors(meta, lambda t: t.to(dev))
            runner.backend.prepare(meta)  # this rank's kernel plan (rank 0's stays on rank 0)
            with torch.inference_mode():
                hidden = text(ids.to(dev), pos.to(dev), runner.kv_cache.layers, meta, runner.backend,
                              None if rows is None else rows.to(dev), None if embeds is None else embeds.to(dev))
        elif kind == "logits":
            with torch.inference_mode():
                text.compute_logits(args[0].to(runner.device))
        elif kind == "allocate":
            runner.kv_cache.allocate(args[0])
        elif kind == "fingerprint":
            dist.gather_object(runner.model.text_fingerprint, None, dst=0, group=group)
        elif kind == "exit":
            break
    del hidden
    dist.destroy_process_group()
    os._exit(0)

"""`docproc run --ray`: one run's documents spread over engine actors on a Ray cluster, with the
guarantees of a single-process run.

The driver (RayPipeline, this process) is a normal run in everything but the engine: it takes
OUT's lock, discovers the inputs, hashes every file, reconciles them with the stored rows (already
done, renamed, removed, skipped) and is the only writer of OUT: each batch of results that comes
back is flushed as one part, with its documents' JSON files, exactly as a plain run flushes its
batches. So OUT need only be on the driver's machine, the lock, incremental skips and crash safety
are the plain run's, and a run can be finished by a plain run (or a plain run by a Ray run) under
the same configuration fingerprint.

The documents that need the engine go to Ray Data as one item per group of identical files (the
same SHA-256: the second one's pages are prefix-cache hits on the engine that has them) and are
mapped by `EngineWorker`, an actor class with one engine each (one GPU each on CUDA) for its life.
A worker runs its batch through the same code as `docproc run` (open, render and hash pages,
blank pages, windows, the query set and its rules, answers, error rows) and returns rows, totals,
page hashes and its own running figures; renders stay on the worker because a page's pixels are
~100 times its file's bytes. The manifest adds `ray`: the cluster, each worker's figures and the
documents retried; `dedup` counts unique pages over the whole run and the encodes of all workers.

Faults: a document's own problems are its error rows, on the worker as in a plain run. A worker
whose process dies (killed, out of memory, a device error) is restarted by Ray, which runs its
batch again (Ray Data's defaults for actors); a small ledger actor tells the worker that this is
a retry, and the retry runs the batch one group of documents at a time, each group's result kept
as it finishes, so that a group the worker dies in twice is marked failed (error_kind "worker")
and the others are answered. A fault of the environment on a worker (the model cannot be loaded,
the device fails) stops the run as it would a plain one.

Required of a multi-node cluster: every node sees the inputs and the model (and draft) folders
at the paths the driver gives (a shared or replicated read-only file system); OUT is written by
the driver alone.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import pickle
import re
import signal
import socket
import tempfile
import time
from dataclasses import asdict, fields, replace

from docproc.errors import DeviceUnavailable, EnvironmentFault, ModelUnavailable, OutputUnwritable, QueriesUnusable
from docproc.pipeline.documents import DocumentWork
from docproc.pipeline.feed import Feed
from docproc.pipeline.run import Pipeline, UsageError
from docproc.pipeline.settings import RunSettings, RunTotals
from docproc.pipeline.streamer import _Streamer

__all__ = ["RayPipeline", "EngineWorker", "ClusterUnavailable"]

WORKER_DIED = ("its engine worker died twice while running it (the process was killed: out of memory, a device "
               "error or a signal; the Ray logs of the worker's node say which)")
LOAD_DEATHS = 2  # workers dying while they load the engine: the run stops (a fault of the environment)
BATCHES_PER_WORKER = 4  # a pass hands each worker at least this many batches when there are documents for it
_FAULTS = {"model": ModelUnavailable, "device": DeviceUnavailable, "output": OutputUnwritable,
           "queries": QueriesUnusable}


class ClusterUnavailable(DeviceUnavailable):
    """The Ray cluster cannot be started, reached, or hold the engine actors asked for."""
    kind = "cluster"


def _check_reachable(address: str | None) -> None:
    """A HOST:PORT address that refuses connections fails at once (ray.init would retry for
    minutes); "auto", "local" and ray:// addresses are left to Ray."""
    if not address or address in ("auto", "local") or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=10):
            pass
    except (OSError, ValueError) as e:
        raise ClusterUnavailable(f"cannot reach the Ray cluster at {address}: {e}; start it (ray start --head) or "
                                 f"check --ray-address") from None


@contextlib.contextmanager
def _stderr_dropped(drop: bool):
    """File descriptor 2 pointed at /dev/null meanwhile (the C++ log lines of Ray's start-up)."""
    if not drop:
        yield
        return
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _fault(kind: str, message: str) -> EnvironmentFault:
    return _FAULTS.get(kind, EnvironmentFault)(message)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)(?:: |$)")
_IMPORT_FIX = "; install docproc the same way on every node of the cluster"


def worker_failure(e: Exception) -> str:
    """What a Ray error says happened on the worker, in one line without terminal colours: the
    worker's own exception where it raised one (a RayTaskError's cause: "ImportError: ..."), else
    Ray's first line ("WorkerCrashedError: ..."). An import that failed there names the fix."""
    import ray

    cause = getattr(e, "cause", None) if isinstance(e, ray.exceptions.RayTaskError) else None
    while (isinstance(cause, BaseException) and cause.__cause__ is not None
           and type(cause).__module__.startswith("ray.")):
        cause = cause.__cause__  # Ray Data's UserCodeException: the user code's exception is its cause
    if isinstance(cause, ray.exceptions.RayError) and cause is not e:
        return worker_failure(cause)
    if isinstance(cause, BaseException):
        lines = [ln.strip() for ln in _ANSI.sub("", str(cause)).splitlines() if ln.strip()]
        name, text = type(cause).__name__, lines[0] if lines else "(no message)"
    else:
        lines = [ln.strip() for ln in _ANSI.sub("", str(e)).splitlines() if ln.strip()]
        name, text = type(e).__name__, lines[0] if lines else "(no message)"
        if isinstance(e, ray.exceptions.RayActorError) and e.actor_init_failed:
            # the actor's own exception survives only as the last line of its traceback's text
            raised = [ln for ln in lines if _EXCEPTION_LINE.match(ln)]
            if raised:
                name, _, text = raised[-1].partition(": ")
    return f"{name}: {text}" + (_IMPORT_FIX if name in ("ImportError", "ModuleNotFoundError") else "")


def _probe_failure(e: Exception) -> str:
    """How the task that loads the model for the fingerprint (run at most twice: max_retries=1,
    which Ray uses only when its process dies) ended, from Ray's error."""
    import ray

    x = ray.exceptions
    if isinstance(e, (x.WorkerCrashedError, x.NodeDiedError)):
        how = ("died twice (killed: out of memory, a device error or a signal; the Ray logs of its node say "
               "which)")
    elif isinstance(e, x.OutOfMemoryError):
        how = "was killed by Ray's memory monitor (its node is short of memory)"
    else:
        how = "failed"
    return f"the Ray worker that loads the model to fingerprint this configuration {how}: {worker_failure(e)}"


class _WorkerPipeline(DocumentWork):
    """A run's document work without its output folder: a batch's documents go through the plain
    run's loop (pipeline/streamer.py: rendered ahead of the engine, handed to it as they are ready),
    rows are kept (not flushed) and handed to the driver, the driver's run id and fingerprint are
    used, warnings are collected."""

    def __init__(self, settings: RunSettings, queries, run_id: str, cfg: str | None, key: str | None) -> None:
        self.warnings: list[str] = []
        super().__init__(settings, queries, run_id, self._collect, cfg=cfg)
        self.store = None  # the driver's alone
        self._cached_cfg = cfg  # checked against this engine's own when it loads
        self._key = key
        self.corrected: str | None = None  # this engine's fingerprint, where the driver's was stale

    def new_figures(self) -> None:
        super().new_figures()
        self.warnings = []

    def render_workers(self) -> int:
        """--render-workers, or by default one thread: a batch's feed lives as long as the batch,
        and render processes would be started again for every batch."""
        return 0 if self.s.render_workers is None else self.s.render_workers

    def _collect(self, event: str, data: dict) -> None:
        if event == "warning":
            self.warnings.append(data["message"])

    def _flush(self) -> None:
        pass  # the rows go back to the driver with the batch

    def _write_config_cache(self, key: str, cfg: str) -> None:
        self.corrected = cfg  # the driver corrects OUT's cache

    def failed(self, docs: list, message: str) -> dict:
        """Every document of docs as an error row of kind "worker" (its worker died in it twice)."""
        self.new_figures()
        for cand, sha in docs:
            self._file_row(cand, sha, "error", message, "worker")
        return self._result()

    def process(self, docs: list) -> dict:
        """Run (candidate, file hash) pairs; the rows of each and this batch's figures."""
        self.new_figures()
        try:
            # hashed again (the verdict): a file changed since the driver hashed it keeps its new
            # hash on its rows (the driver's only grouped it); nothing is done or moved here
            feed = Feed([cand for cand, _ in docs], self._verdict, self.pages_in_flight(), self.render_workers())
            streamer = _Streamer(self, feed)
            try:
                streamer.run()
            except BaseException:
                if streamer.stream is not None:  # the actor's engine outlives the batch: nothing of it left running
                    streamer.stream.abort()
                raise
            finally:
                feed.close()
        except EnvironmentFault as e:
            return {"fault": (e.kind, str(e))}
        except Exception as e:  # noqa: BLE001 -- a bug outside the per-document boundary: its documents fail
            finished = {rel for rel, _, _ in self._pending}
            for cand, sha in docs:
                if cand.rel not in finished:
                    self._file_row(cand, sha, "error", f"{type(e).__name__}: {e}", "internal")
        return self._result()

    def _result(self) -> dict:
        return {"docs": self._pending, "totals": asdict(self.totals), "page_hashes": sorted(self.page_hashes),
                "failures": self.failures, "warnings": self.warnings, "stage_seconds": dict(self.stage_seconds),
                "cfg": self.cfg, "corrected": self.corrected}


class EngineWorker:
    """The engine actor of a `docproc run --ray`: a callable class for `Dataset.map_batches`
    whose batches hold pickled (group index, [(candidate, file hash), ...]) items and whose
    output is one pickled result per batch."""

    def __init__(self, settings: RunSettings, queries, run_id: str, cfg: str | None, key: str | None, ledger,
                 concurrency: int, threads: int | None = None) -> None:
        if threads:
            import torch

            torch.set_num_threads(threads)
        import ray

        self.p = _WorkerPipeline(settings, queries, run_id, cfg, key)
        self.ledger = ledger
        self.fault: tuple[str, str] | None = None
        # the engine loads now, so that a worker that dies later died in its documents; the
        # ledger counts loads, so that workers dying as they load stop the run instead
        died = ray.get(ledger.begin_load.remote(concurrency))
        t0 = time.perf_counter()
        if died >= LOAD_DEATHS:
            self.fault = ("device", f"engine workers died {died} times while loading the model (out of memory, a "
                                    f"device error?): the Ray logs of their nodes say why")
        else:
            try:
                self.p._engine()
            except EnvironmentFault as e:
                self.fault = (e.kind, str(e))
            ray.get(ledger.loaded.remote())
        load_seconds = time.perf_counter() - t0
        self.id = f"{socket.gethostname()}:{os.getpid()}"
        self.seen: set[str] = set()  # pages this engine has run
        self.figures = {"batches": 0, "documents": 0, "pages": 0, "generated_tokens": 0, "engine_seconds": 0.0,
                        "open_render_hash_seconds": 0.0, "load_seconds": load_seconds}

    def __call__(self, batch):
        import pyarrow as pa
        import ray

        items = [pickle.loads(b) for b in batch["payload"].to_pylist()]
        if self.fault is not None:
            return pa.table({"payload": pa.array([pickle.dumps({"fault": self.fault, "groups": []})], type=pa.binary())})
        if ray.get(self.ledger.begin.remote(items[0][0])) == 0:
            result = self.p.process([d for _, docs in items for d in docs])
            result["retried"] = 0
        else:
            # Ray runs a batch again on the restarted actor when its worker died: now group by
            # group, each group's result kept by the ledger as it finishes, so that only the group
            # it died in runs again, and a group it dies in on this retry too is marked failed
            parts = []
            for g, docs in items:
                begun, kept = ray.get(self.ledger.begin_group.remote(g))
                if kept is not None:
                    parts.append(pickle.loads(kept))
                elif begun:
                    parts.append(self.p.failed(docs, WORKER_DIED))
                else:
                    part = self.p.process(docs)
                    if "fault" not in part:
                        ray.get(self.ledger.keep.remote(g, pickle.dumps(part)))
                    parts.append(part)
            result = _merge(parts)
            result["retried"] = sum(len(docs) for _, docs in items)
        result["groups"] = [g for g, _ in items]
        if "fault" not in result:
            f = self.figures
            f["batches"] += 1
            f["documents"] += result["totals"]["documents"]
            f["pages"] += result["totals"]["pages"]
            f["generated_tokens"] += result["totals"]["generated_tokens"]
            f["engine_seconds"] += result["stage_seconds"]["engine"]
            f["open_render_hash_seconds"] += result["stage_seconds"]["open_render_hash"]
            f["load_seconds"] += result["stage_seconds"]["load_model"]
            self.seen.update(result["page_hashes"])
            info = self.p.llm.cache_info() if self.p.llm is not None else {}
            result["spec"] = self.p.llm.spec_info() if self.p.llm is not None else None
            result["worker"] = {"id": self.id, "node": _node_ip(), "pid": os.getpid(), "gpus": _gpu_ids(),
                                **{k: round(v, 3) if isinstance(v, float) else v for k, v in f.items()},
                                "unique_pages": len(self.seen), "vision_encodes": info.get("num_encoded_images"),
                                "engine": info,
                                "tokens_per_second": round(f["generated_tokens"] / f["engine_seconds"], 2)
                                if f["engine_seconds"] > 0 else None}
        return pa.table({"payload": pa.array([pickle.dumps(result)], type=pa.binary())})


def _merge(parts: list[dict]) -> dict:
    """One batch's result from the results of its groups."""
    faults = [p for p in parts if "fault" in p]
    if faults:
        return faults[0]
    out = {"docs": [], "totals": {}, "page_hashes": set(), "failures": [], "warnings": [], "stage_seconds": {},
           "cfg": None, "corrected": None}
    for p in parts:
        out["docs"] += p["docs"]
        out["failures"] += p["failures"]
        out["warnings"] += p["warnings"]
        out["page_hashes"].update(p["page_hashes"])
        for k in ("totals", "stage_seconds"):
            for name, v in p[k].items():
                out[k][name] = out[k].get(name, 0) + v
        out["cfg"] = p["cfg"] or out["cfg"]
        out["corrected"] = p["corrected"] or out["corrected"]
    out["page_hashes"] = sorted(out["page_hashes"])
    return out


class _Ledger:
    """How often each batch and group of a run was begun, and the results of groups finished on a
    retry: what lets a worker that Ray restarted tell a retry from a first run (a small actor of
    the driver's run, on no CPU)."""

    def __init__(self) -> None:
        self.loads_begun = self.loads_done = 0
        self.batches: dict[int, int] = {}
        self.groups: dict[int, int] = {}
        self.kept: dict[int, bytes] = {}

    def begin_load(self, concurrency: int) -> int:
        """A worker starts loading the engine: how many died loading it so far (at least; as many
        as `concurrency` may be loading at once)."""
        died = max(0, self.loads_begun - self.loads_done - concurrency + 1)
        self.loads_begun += 1
        return died

    def loaded(self) -> None:
        self.loads_done += 1

    def begin(self, batch: int) -> int:
        n = self.batches.get(batch, 0)
        self.batches[batch] = n + 1
        return n

    def begin_group(self, group: int) -> tuple[int, bytes | None]:
        n = self.groups.get(group, 0)
        self.groups[group] = n + 1
        return n, self.kept.get(group)

    def keep(self, group: int, result: bytes) -> None:
        self.kept[group] = result

    def forget(self, groups: list[int]) -> None:
        for g in groups:
            self.kept.pop(g, None)


def _probe(settings: RunSettings, queries, key: str | None) -> dict:
    """On a cluster node: load the engine once for the configuration fingerprint (a run whose
    configuration the cache does not know yet)."""
    p = _WorkerPipeline(settings, queries, "", None, key)
    try:
        cfg = p.config_fingerprint()
        return {"cfg": cfg, "model": p.model_fingerprint(), "spec": p.llm.spec_info()}
    except EnvironmentFault as e:
        return {"fault": (e.kind, str(e))}


def _node_ip() -> str | None:
    import ray

    try:
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 -- a figure only
        return None


def _gpu_ids() -> list:
    import ray

    try:
        return [str(x) for x in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
    except Exception:  # noqa: BLE001 -- a figure only
        return []


class RayPipeline(Pipeline):
    defer_fingerprint = False  # (the workers are handed it)

    def __init__(self, settings: RunSettings, reporter=None) -> None:
        if importlib.util.find_spec("ray") is None:
            raise UsageError("--ray needs Ray: pip install 'docproc[ray]'")
        # the workers' working folder is not this one: every path they are given is absolute
        settings = replace(settings, inputs=[os.path.abspath(p) for p in settings.inputs],
                           out=os.path.abspath(settings.out), model=os.path.abspath(settings.model),
                           draft=os.path.abspath(settings.draft) if settings.draft else None,
                           queries=os.path.abspath(settings.queries) if settings.queries else None)
        super().__init__(settings, reporter=reporter)
        self._started_ray = False  # this run connected (or started the cluster): it disconnects at the end
        self._probed: dict | None = None
        self._gpus: int | None = None  # per engine actor, once the cluster is sized
        self._size = 1
        self._spec: dict | None = None  # the draft's figures, from the first worker that reports them
        self._warned: set[str] = set()
        self.workers: dict[str, dict] = {}  # worker id -> its latest figures
        self.ray_info: dict = {"address": settings.ray_address, "local_cluster": settings.ray_address is None}
        self.stage_seconds["cluster_start"] = 0.0

    def run(self) -> dict:
        try:
            return super().run()
        finally:
            if self._started_ray:
                import ray

                ray.shutdown()

    # ---- the engine lives on the workers -------------------------------------------------------
    def _engine(self):
        raise RuntimeError("the driver of a Ray run loads no engine")

    def config_fingerprint(self) -> str:
        if self._probed is None:
            import ray

            self._cluster()
            t0 = time.perf_counter()
            task = ray.remote(num_gpus=self._gpus, num_cpus=1, max_retries=1)(_probe)
            try:
                probed = ray.get(task.remote(self.s, self.queries, self._key))
            except ray.exceptions.RayError as e:
                raise ClusterUnavailable(_probe_failure(e)) from None
            finally:
                self.stage_seconds["fingerprint_load"] = round(time.perf_counter() - t0, 3)
            if "fault" in probed:
                raise _fault(*probed["fault"])
            self._probed = probed
        return self._probed["cfg"]

    def model_fingerprint(self) -> dict:
        if self._probed is not None:
            return dict(self._probed["model"])
        return dict(self._cached_model or {})

    def model_info(self) -> dict | None:
        return self.model_fingerprint() if (self._probed or self._cached_model) else None

    # ---- the cluster -------------------------------------------------------------------------
    def _cluster(self) -> None:
        """Connect to the cluster (or start a local one) once, and size the engine actors."""
        if self._gpus is not None:
            return
        import ray

        t0 = time.perf_counter()
        if not ray.is_initialized():
            if not self.s.debug:  # Ray's own C++ log lines on the terminal of a batch tool: only fatal ones
                os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
            opts = dict(include_dashboard=False, log_to_driver=self.s.debug,
                        logging_level=logging.INFO if self.s.debug else logging.ERROR)
            where = f"the Ray cluster at {self.s.ray_address}" if self.s.ray_address else "a local Ray cluster"
            _check_reachable(self.s.ray_address)
            # ray.init puts its own handlers on SIGTERM and SIGINT: the run's stay (a signal still
            # ends the run with a manifest); its start-up lines on stderr are dropped unless --debug
            handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
            try:
                # Ray puts the driver's working folder first on its workers' sys.path, unless the
                # job has a working_dir: a folder named docproc there (a clone of the repository,
                # run from its parent) would be imported in place of the installed package. The
                # job's working_dir is an empty folder (Ray uploads it at init, 0 bytes).
                with tempfile.TemporaryDirectory(prefix="docproc-ray-") as empty, _stderr_dropped(not self.s.debug):
                    opts["runtime_env"] = {"working_dir": empty}
                    if self.s.ray_address:
                        ray.init(address=self.s.ray_address, **opts)
                    else:
                        # logical CPUs: the engine actors hold one each and Ray Data's own tasks still run
                        n = self.s.data_parallel_size or 1
                        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, n + 2), **opts)
            except Exception as e:  # noqa: BLE001 -- whatever Ray raises: the run cannot start, named
                raise ClusterUnavailable(f"cannot start or reach {where}: {type(e).__name__}: {e}; start one "
                                         f"(ray start --head) or check --ray-address") from None
            finally:
                for sig, handler in handlers.items():
                    if handler is not None:
                        signal.signal(sig, handler)
            self._started_ray = True
        self.stage_seconds["cluster_start"] += time.perf_counter() - t0
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        use_gpu = self.s.device != "cpu" and gpus > 0
        if self.s.device.startswith("cuda") and gpus == 0:
            raise ClusterUnavailable("--device cuda, but the Ray cluster has no GPU: pass --device cpu or auto, or "
                                     "add GPU nodes")
        tp = self.s.tensor_parallel_size  # GPUs per engine actor
        n = self.s.data_parallel_size or (max(1, gpus // tp) if use_gpu else 1)
        if use_gpu and n * tp > gpus:
            raise ClusterUnavailable(f"{n} engine actors of {tp} GPU(s) need {n * tp} GPUs, and the Ray cluster has "
                                     f"{gpus}: pass --data-parallel-size {gpus // tp} or fewer")
        self._gpus = tp if use_gpu else 0
        self._size = n
        self.ray_info.update(data_parallel_size=n, gpus_per_worker=self._gpus, cluster_gpus=gpus,
                             cluster_cpus=int(resources.get("CPU", 0)), nodes=len(ray.nodes()))

    # ---- the run -----------------------------------------------------------------------------
    NO_XGRAMMAR = ("xgrammar, a dependency of docproc, is missing on the driver: answers are decoded as free text "
                   "and checked against their query's rule afterwards; pip install xgrammar on every node to decode "
                   "under the rules")

    def _process(self) -> None:
        candidates = self._start()
        groups: dict[str, list] = {}  # file hash -> its documents: identical files go to one engine
        for cand in candidates:
            sha = self._triage(cand)
            if sha is not None:
                groups.setdefault(sha, []).append((cand, sha))
        self._flush()  # skips, errors, renames: written before the engine work starts
        if groups:
            self._distribute(list(groups.values()))
        self._finish()

    def _distribute(self, groups: list[list]) -> None:
        import ray
        from ray.data.context import DataContext

        self._cluster()
        self.ray_info.update(groups=len(groups), retried_documents=0, failed_by_worker=0)
        t0 = time.perf_counter()
        context = DataContext.get_current()
        saved = context.enable_progress_bars
        quiet = logging.getLogger("ray.data")
        level = quiet.level
        ledger = ray.remote(num_cpus=0, max_restarts=0)(_Ledger).remote()
        try:
            context.enable_progress_bars = False
            if not self.s.debug:  # a worker's error is the run's fault, told in one line
                quiet.setLevel(logging.CRITICAL)
            n = self._size
            per_batch = max(1, min(self.pages_in_flight(), math.ceil(len(groups) / (n * BATCHES_PER_WORKER))))
            threads = None if self._gpus else max(1, (os.cpu_count() or 1) // n)
            items = list(enumerate(groups))
            ds = ray.data.from_items([{"payload": pickle.dumps(item)} for item in items],
                                     override_num_blocks=max(1, math.ceil(len(items) / per_batch)))
            # Ray Data's defaults for actors: a worker that dies is restarted and its batch run again
            # (EngineWorker tells a retry from a first run by the ledger)
            ds = ds.map_batches(EngineWorker, batch_size=per_batch, batch_format="pyarrow",
                                compute=ray.data.ActorPoolStrategy(size=n), num_gpus=self._gpus, num_cpus=1,
                                fn_constructor_kwargs=dict(settings=self.s, queries=self.queries, run_id=self.run_id,
                                                           cfg=self.cfg, key=self._key, ledger=ledger,
                                                           concurrency=n, threads=threads))
            done: set = set()
            try:
                for block in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                    for blob in block.column("payload").to_pylist():
                        result = pickle.loads(blob)
                        self._take(result)
                        done.update(result["groups"])
                        if result.get("retried"):
                            ledger.forget.remote(result["groups"])
            except ray.exceptions.RayError as e:  # a worker's own error outside any document
                starting = isinstance(e, ray.exceptions.RayActorError) and e.actor_init_failed
                raise ClusterUnavailable(f"an engine worker failed{' as it started' if starting else ''}: "
                                         f"{worker_failure(e)}") from None
            for g, docs in items:  # none, unless Ray lost a batch without an error
                if g not in done:
                    for cand, sha in docs:
                        self._file_row(cand, sha, "error", "its batch did not come back from the Ray cluster",
                                       "worker")
            self._flush()
        finally:
            context.enable_progress_bars = saved
            quiet.setLevel(level)
            ray.kill(ledger)
            self.stage_seconds["engine"] += time.perf_counter() - t0

    def _take(self, result: dict) -> None:
        """One batch's results from a worker: its rows flushed as a part, its figures added."""
        if "fault" in result:
            raise _fault(*result["fault"])
        self.ray_info["retried_documents"] += result.get("retried", 0)
        self.ray_info["failed_by_worker"] += sum(r[0].get("error_kind") == "worker" for _, r, _ in result["docs"])
        if result["corrected"] and result["corrected"] != self.cfg:
            # the cache missed a change its key does not see (plain runs do the same on load)
            self.cfg, self._cached_cfg = result["corrected"], None
            self._write_config_cache(self._key, result["corrected"])
            self.report("warning", {"message": "the cached configuration fingerprint was stale; documents skipped "
                                               "as done are rechecked by the next run"})
        for rel, rows, write_json in result["docs"]:
            self._pending.append((rel, rows, write_json))
            first = rows[0]
            self.report("document", {"path": rel, "status": first["doc_status"], "pages": first.get("pages"),
                                     **({"error": first["error"], "error_kind": first.get("error_kind")}
                                        if first["doc_status"] == "error" else {})})
        for f in fields(RunTotals):
            setattr(self.totals, f.name, getattr(self.totals, f.name) + result["totals"][f.name])
        self.page_hashes.update(result["page_hashes"])
        self.failures.extend(result["failures"])
        for message in result["warnings"]:
            if message not in self._warned:
                self._warned.add(message)
                self.report("warning", {"message": f"on an engine worker: {message}"})
        self.stage_seconds["open_render_hash"] += result["stage_seconds"]["open_render_hash"]
        self.workers[result["worker"]["id"]] = result["worker"]
        if self._spec is None:
            self._spec = result["spec"]
        self._flush()
        self.report("batch", {"totals": asdict(self.totals), "unique_pages": len(self.page_hashes),
                              "engine_seconds": self.stage_seconds["engine"], "worker": result["worker"]})

    def _write_config_cache(self, key: str | None, cfg: str) -> None:
        if key is not None:
            super()._write_config_cache(key, cfg)

    def _manifest(self, started: str, seconds: float, status: str, fault: dict | None,
                  exit_code: int | None) -> dict:
        m = super()._manifest(started, seconds, status, fault, exit_code)
        workers = sorted(self.workers.values(), key=lambda w: w["id"])
        m["ray"] = {**self.ray_info, "workers": workers}
        m["engine_loaded"] = bool(workers) or self._probed is not None
        m["draft"] = self._spec or (self._probed or {}).get("spec")
        encodes = [w["vision_encodes"] for w in workers if w.get("vision_encodes") is not None]
        # unique pages over the whole run, against the encodes of all workers together
        m["dedup"]["vision_encodes"] = sum(encodes) if encodes else None
        # the workers load in parallel: the slowest one's load is the run's, and the engine stage
        # (from the first actor's start to the last result) is counted without it
        load = max([w["load_seconds"] for w in workers], default=0.0)
        stages = m["stage_seconds"]
        stages["load_model"] = round(load, 3)
        stages["engine"] = round(max(0.0, self.stage_seconds["engine"] - load), 3)
        t = self.totals
        m["tokens_per_second"] = round(t.generated_tokens / stages["engine"], 2) if stages["engine"] > 0 else None
        if workers:  # the engine's configuration as the first worker has it (each worker's under ray.workers)
            m["engine"] = workers[0]["engine"]
        return m

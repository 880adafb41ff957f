"""Loading the engine, and the configuration fingerprint that decides which documents are done.

The fingerprint is the hash of components taken from the loaded engine (model and draft
fingerprints, KV format, dtype) and the settings that change answers; a cache keyed by what it is
computed from (the model folders' files, every setting, the query set) lets a run with nothing new
to do skip loading the model, and the components of every fingerprint a run computes are kept
(.docproc/fingerprints.json) so that a later run can say what changed. Pipeline inherits this; it
needs self.s (RunSettings), self.store, self.queries, self.llm, self.report and self.stage_seconds.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path

from docproc.errors import DeviceUnavailable, EnvironmentFault, ModelUnavailable, QueriesUnusable
from docproc.pipeline.reconcile import fingerprint_of
from docproc.pipeline.runstore import atomic_write_bytes, output_fault
from docproc.pipeline.signals import reraise_swallowed

PROMPT_VERSION = "v1"
CONFIG_CACHE_ENTRIES = 16  # configuration fingerprints kept (.docproc/config_cache.json)
FINGERPRINTS_FILE = "fingerprints.json"  # in .docproc: fingerprint -> its components and query set's name
# Bumped when what config_fingerprint computes changes without a setting changing, so that cached
# entries made under the old rules are not reused (2: FP4 KV records its value-slot count; 3: the
# constraint mode counts only when a query of the set is constrained).
FINGERPRINT_RULES = 3


def load_fault(e: Exception, model: str, draft: str | None) -> EnvironmentFault:
    """An exception from loading the engine as the fault that stops the run."""
    if type(e).__name__ in ("AcceleratorError", "CudaError") or "CUDA error" in str(e):
        return DeviceUnavailable(f"the device failed while loading {model}: {e}; check the GPU (nvidia-smi)")
    if type(e).__name__ == "OutOfMemoryError":
        return DeviceUnavailable(f"not enough device memory to load {model}"
                                 f"{' and ' + draft if draft else ''}: lower --gpu-memory-utilization, free "
                                 f"the GPU, or use a smaller model")
    return ModelUnavailable(f"cannot load {model}{' with draft ' + draft if draft else ''}: "
                            f"{type(e).__name__}: {e}")


def keyed_settings(s) -> dict:
    """The settings a config-cache key holds: every one but the inputs and outputs and those that
    decide where and how fast, not what (the fingerprint holds none of them). Keys of runs made
    before a change stay: --batch-pages (unkeyed since) is held at its default, the removed
    --fp4-value-slots at its default, load_format and batch_invariant only when set."""
    unkeyed = ("inputs", "out", "force", "formats", "debug", "ray", "ray_address", "data_parallel_size",
               "render_workers")
    settings = {k: v for k, v in asdict(s).items() if k not in unkeyed}
    settings["batch_pages"] = 32
    settings["fp4_value_slots"] = None
    if settings.get("load_format") == "auto":
        del settings["load_format"]
    if not settings.get("batch_invariant"):
        settings.pop("batch_invariant", None)
    return settings


class EngineSetup:
    _cached_model: dict | None = None  # the model's fingerprints from the config cache
    _cached_cfg: str | None = None  # the fingerprint taken from the cache, until checked
    _key: str | None = None  # config_key() of this run
    cfg: str | None = None  # the run's configuration fingerprint
    constrain: bool = True  # answers decoded under their queries' rules (xgrammar is installed)
    _constraints_checked = False  # every query's constraint compiles (check_constraints)
    _own_llm: bool = False  # this run loaded the engine (close_engine closes it)
    _components: dict | None = None  # fingerprint -> its components, for those this process computed

    def config_key(self) -> str | None:
        """What a run's configuration fingerprint is computed from, short of loading the model: the
        model and draft folders' files (name, size, modification time), every setting but the
        inputs and outputs, the query set, the prompt version, docproc's version and what decides
        whether CUDA is there (`auto` choices depend on it), read without importing torch. None
        when a folder is missing (loading it will say why)."""
        from docproc import __version__
        from docproc.engine.device import cuda_environment

        stamps = {}
        for name, folder in (("model", self.s.model), ("draft", self.s.draft)):
            if folder is None:
                continue
            root = Path(folder)
            if not root.is_dir():
                return None
            stamps[name] = sorted((str(f.relative_to(root)), st.st_size, st.st_mtime_ns)
                                  for f in root.rglob("*") if f.is_file() for st in [f.stat()])
        payload = {"files": stamps, "settings": keyed_settings(self.s), "queries": self.queries.fingerprint,
                   "constraints": self.constrain, "prompt": PROMPT_VERSION, "docproc": __version__,
                   "cuda": cuda_environment(), "rules": FINGERPRINT_RULES}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()

    def _remember_components(self, cfg: str) -> None:
        """Keep the components of a fingerprint this run computed, for later runs to explain it."""
        components = self._components.get(cfg) if self._components else None
        if components is None or self.store is None:
            return
        known = self.stored_components()
        if known.get(cfg, {}).get("components") == components:
            return
        known[cfg] = {"components": components, "query_set": self.queries.name}
        try:
            atomic_write_bytes(self.store.state_dir / FINGERPRINTS_FILE, json.dumps(known, indent=1).encode())
        except OSError as e:
            raise output_fault(e, self.store.out) from None

    def stored_components(self) -> dict:
        """fingerprint -> {"components", "query_set"} of every fingerprint runs in OUT computed and
        kept (none before components were kept)."""
        if self.store is None:
            return {}
        try:
            data = json.loads((self.store.state_dir / FINGERPRINTS_FILE).read_text())
        except (OSError, ValueError):  # none yet, or unreadable: explanations only
            return {}
        return {k: v for k, v in data.items() if isinstance(v, dict) and isinstance(v.get("components"), dict)} \
            if isinstance(data, dict) else {}

    def config_components_known(self) -> dict | None:
        """The components of this run's fingerprint, where known without loading the model: this
        process computed them, or a run kept them; None otherwise."""
        if self._components and self.cfg in self._components:
            return self._components[self.cfg]
        return self.stored_components().get(self.cfg, {}).get("components")

    def _write_config_cache(self, key: str, cfg: str) -> None:
        cache = self.store.read_config_cache()
        cache.pop(key, None)
        cache[key] = {"config_fingerprint": cfg, "model": self.model_fingerprint()}
        self.store.write_config_cache(dict(list(cache.items())[-CONFIG_CACHE_ENTRIES:]))  # the most recent last

    def cached_config(self) -> str | None:
        """The configuration fingerprint from the config cache, when an earlier run computed it
        from the same files and settings; None otherwise (the engine must load to know it). Reads
        OUT, writes nothing."""
        key = self._key = self.config_key()
        if key is not None and self.llm is None:
            hit = self.store.read_config_cache().get(key)
            if isinstance(hit, dict) and isinstance(hit.get("config_fingerprint"), str):
                self._cached_model = hit.get("model")
                self._cached_cfg = hit["config_fingerprint"]
                return self._cached_cfg
        return None

    def _config(self) -> str:
        """The configuration fingerprint: from the config cache where it hits (the model is then
        loaded only if a document needs work), else from the loaded engine (and cached)."""
        cached = self.cached_config()
        if cached is not None:
            return cached
        key = self._key
        cfg = self.config_fingerprint()
        self._remember_components(cfg)
        if key is not None:
            self._write_config_cache(key, cfg)
        return cfg

    def check_constraints(self) -> None:
        """QueriesUnusable (exit 2) naming the first query whose constraint xgrammar cannot compile:
        checked as the engine is about to load, so that no model loads for a run that cannot use it."""
        if self._constraints_checked or not self.constrain:
            return
        from docproc.engine.structured import compile_problem

        for q in self.queries.queries:
            so = q.structured_outputs()
            problem = compile_problem(so) if so is not None else None
            if problem is not None:
                raise QueriesUnusable(f"{self.queries.source}: query {q.name!r}: the grammar backend cannot compile its "
                                      f"{'schema' if so.kind == 'json' else 'constraint'}: {problem}; change the query "
                                      f"(no model was loaded, nothing was answered)")
        self._constraints_checked = True

    def _engine(self):
        if self.llm is None:
            t0 = time.perf_counter()
            self.check_constraints()
            from docproc import LLM

            self.report("load_start", {"model": self.s.model, "draft": self.s.draft})
            try:
                self._own_llm = True
                self.llm = LLM(self.s.model, device=self.s.device, kv_cache_dtype=self.s.kv_cache,
                               max_num_batched_tokens=self.s.max_num_batched_tokens,
                               gpu_memory_utilization=self.s.gpu_memory_utilization, seed=self.s.seed,
                               speculative_model=self.s.draft, num_speculative_tokens=self.s.spec_k,
                               draft_vision=self.s.draft_vision, enforce_eager=self.s.enforce_eager,
                               batch_invariant=self.s.batch_invariant,
                               quantization=self.s.quantization,
                               tensor_parallel_size=self.s.tensor_parallel_size, load_format=self.s.load_format)
            except EnvironmentFault:
                raise
            except Exception as e:  # noqa: BLE001 -- whatever loading raises stops the run, named
                reraise_swallowed()  # (a signal whose RunInterrupted torch turned into its own error)
                raise load_fault(e, self.s.model, self.s.draft) from e
            finally:
                self.stage_seconds["load_model"] += time.perf_counter() - t0
                if hasattr(self, "timeline"):
                    self.mark("load_model", t0, time.perf_counter())
            self.report("load_end", {"seconds": round(time.perf_counter() - t0, 3)})
            cached = self._cached_cfg
            if cached is not None:
                real = self.config_fingerprint()
                if real != cached:
                    # the cache missed a change its key does not see: the rest of the run uses the
                    # real fingerprint, and the cache is corrected (documents this run skipped as
                    # done under the stale one are checked again by the next run)
                    self.cfg, self._cached_cfg = real, None
                    self._remember_components(real)
                    self._write_config_cache(self._key, real)
                    self.report("warning", {"message": "the cached configuration fingerprint was stale; "
                                                       "documents skipped as done are rechecked by the next run"})
        return self.llm

    def close_engine(self) -> None:
        """Close the engine this run loaded (its tensor-parallel ranks stop now, not when the object
        is collected); an engine the caller passed in stays theirs."""
        if self._own_llm and self.llm is not None:
            self.llm.close()
            self.llm = None

    def model_fingerprint(self) -> dict:
        if self.llm is None and self._cached_model:
            return dict(self._cached_model)
        return self._engine().model_fingerprint()

    def config_fingerprint(self) -> str:
        components = self.config_components()
        cfg = fingerprint_of(components)
        if self._components is None:
            self._components = {}
        self._components[cfg] = components
        return cfg

    def config_components(self) -> dict:
        """What the configuration fingerprint is the hash of: the settings and engine choices that
        change answers. Ones that cannot (the constraint mode when no query is constrained) are
        held at one value; those that matter for some documents only (DPI and anchor text for
        PDFs, --max-pages for documents longer than a limit) are weighed per document
        (reconcile.same_answers); fingerprints of an older rule that differ only so are taken as
        equal (reconcile.ConfigHistory)."""
        info = self._engine().cache_info()
        spec = self._engine().spec_info()
        # greedy speculation is lossless, but sampled output depends on the draft: fingerprint it
        draft = spec["draft_fingerprint"] if spec else None
        # without a constrained query both modes decode and check alike: True, what a run with
        # xgrammar installed recorded
        constraints = self.constrain or not self.queries.constrained
        payload = {"queries": self.queries.fingerprint, "constraints": constraints,
                   "model": self.model_fingerprint(), "draft": draft,
                   "dpi": self.s.dpi, "max_pages": self.s.max_pages, "kv_cache": info["kv_cache_dtype"],
                   "dtype": info["dtype"], "max_image_tokens": self.s.max_image_tokens, "prompt": PROMPT_VERSION}
        if self.s.anchor_text:  # only when on: runs without it keep their fingerprints
            payload["anchor_text"] = True
        if self.s.batch_invariant:  # likewise: the batch-invariant kernels sum in their own order
            payload["batch_invariant"] = True
        if info.get("weights_fp8"):  # likewise: FP8 weights (the checkpoint's, or quantized at load)
            payload["weights_fp8"] = info["weights_fp8"]
        if info["kv_cache_dtype"] == "fp4":
            # FP4 values have no outlier slots (an option for 2 bought nothing and is gone); the entry
            # stays in every FP4 fingerprint: an entry-less one stands for the older default of 2 slots
            payload["fp4_value_slots"] = 0
        return json.loads(json.dumps(payload))  # as stored: lists, not tuples

    def check_models(self) -> None:
        """The model and draft folders exist and hold a config.json and the tokenizer's files
        (before any import of torch)."""
        from docproc.models.tokenizer_files import missing_tokenizer, special_files

        for what, folder in (("model", self.s.model), ("draft", self.s.draft)):
            if folder is None:
                continue
            p = Path(folder)
            if not p.is_dir():
                flag = "--model" if what == "model" else "--draft"
                raise ModelUnavailable(f"{what} folder {folder} {'is not a folder' if p.exists() else 'does not exist'}: "
                                       f"pass a local checkpoint folder as {flag} (docproc never downloads models)")
            odd = special_files(p)
            if odd is not None:
                raise ModelUnavailable(f"{what} folder {folder} {odd}")
            if not (p / "config.json").is_file():
                raise ModelUnavailable(f"{what} folder {folder} has no config.json: it is not a Hugging Face "
                                       f"checkpoint folder")
            missing = missing_tokenizer(p)
            if missing is not None:
                raise ModelUnavailable(f"{what} folder {folder} {missing}")

    def model_info(self) -> dict | None:
        """The model's fingerprints when they are known without loading anything now."""
        if self.llm is not None or self._cached_model:
            return self.model_fingerprint()
        return None

"""The docproc command line (thin: parsing and display; the work is in docproc.pipeline).

Exit codes of `docproc run` (README, "Exit codes"): 0 every document ok, partial or skipped;
1 finished, some documents failed; 2 usage error (flags, query file, inputs), nothing done;
3 the model or draft is missing or cannot be loaded; 4 the device is missing or failed;
5 the output folder cannot be written (read-only, a file, disk full); 70 an internal error;
75 another run holds the output folder's lock; 130 / 143 stopped by SIGINT / SIGTERM.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperCommand

from docproc.errors import EXIT_DEVICE, EXIT_MODEL, EXIT_OUTPUT, EXIT_USAGE
from docproc.pipeline.settings import bundled_model


class _Command(TyperCommand):
    """Help laid out as a plain command line's: `INPUTS...` in the usage line (typer 0.2x writes
    `{inputs}...`), each option's metavar after it (its name upper-cased where none is given, as
    argparse does; typer 0.2x writes `<str>`, `<bool>`), nothing after a flag."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for p in params:
            if p.metavar is None and p.param_type_name == "option" and not getattr(p, "is_flag", False):
                p.metavar = p.name.upper()
        return params

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [re.sub(r"^\{(.*)\}", r"\1", piece) for piece in super().collect_usage_pieces(ctx)]

    def format_options(self, ctx, formatter) -> None:
        params = self.get_params(ctx)
        args = [((p.metavar or p.name.upper()) + ("..." if p.nargs != 1 else ""), getattr(p, "help", None) or "")
                for p in params if p.param_type_name == "argument"]
        opts = [r for p in params if p.param_type_name == "option" for r in [p.get_help_record(ctx)] if r]
        for title, rows in (("Arguments", args), ("Options", opts)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


def _print_version(value: bool) -> None:
    if value:
        from docproc import __version__

        print(f"docproc {__version__}")
        raise typer.Exit()


# Help text is shown as written (no Rich markup): "pip install 'docproc[ray]'" keeps its brackets.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Extract structured data from folders of PDFs and images with vision-language models.")


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                          help="Print docproc's version and exit.")) -> None:
    pass

# Output that is not a terminal (a pipe, a log file, cron mail) has no width to measure; rich would
# squeeze tables into 80 columns and cut their headers ("answered" -> "answer…"). There the consoles
# are wide enough for every table (COLUMNS, when set, still wins).
WIDE_OUTPUT = 200


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """A reader that went away (`| head`): raise, for the command to finish with its own exit
        code (Rich's default exits 1, whatever the run's outcome)."""
        raise BrokenPipeError


def _console(stderr: bool = False) -> Console:
    console = _Console(stderr=stderr)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = _Console(stderr=stderr, width=WIDE_OUTPUT)
    return console


out_console = _console()
err_console = _console(stderr=True)

EXIT_OK, EXIT_FAILURES, EXIT_INTERNAL, EXIT_LOCKED = 0, 1, 70, 75
EXIT_CODES = {EXIT_OK: "ok", EXIT_FAILURES: "some documents failed", EXIT_USAGE: "usage error",
              EXIT_MODEL: "model unavailable", EXIT_DEVICE: "device unavailable", EXIT_OUTPUT: "output unwritable",
              EXIT_INTERNAL: "internal error", EXIT_LOCKED: "locked", 130: "interrupted (SIGINT)",
              143: "interrupted (SIGTERM)"}
FAILURES_SHOWN = 5  # failed files the summary names before giving a count


def error(message: str, label: str = "error", colour: str = "red") -> None:
    """One line on stderr; the message is shown as written (no Rich markup: '[[query]]' stays)."""
    err_console.print(f"[{colour}]{label}:[/{colour}] {escape(str(message))}", soft_wrap=True)


def shown(key: str) -> str:
    """A document key for the terminal: control characters escaped (the key itself is kept)."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in key)


def parse_formats(value: str) -> tuple[str, ...]:
    """'json,parquet' -> ('json', 'parquet'); raises BadParameter on anything else."""
    from docproc.pipeline.schema import OUTPUT_FORMATS

    items = tuple(dict.fromkeys(x.strip().lower() for x in value.split(",") if x.strip()))
    if not items or set(items) - set(OUTPUT_FORMATS):
        raise typer.BadParameter(f"expected any of {', '.join(OUTPUT_FORMATS)}, comma-separated; got {value!r}")
    return items


def resolve_model(model: Optional[str]) -> str:
    if model:
        return model
    default = bundled_model("target")
    if not (default / "config.json").is_file():
        raise typer.BadParameter(
            f"no --model given and the bundled default model is not installed ({default}): pass --model DIR "
            f"(a local Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint folder)", param_hint="--model")
    return str(default)


def resolve_draft(draft: Optional[str]) -> Optional[str]:
    """--draft DIR, 'none' or 'bundled' (the bundled draft). No --draft: none. The bundled pair is
    two tiny models: on the 2-core CPU a run with the draft took 3-7% longer (it prefills every
    page itself), and on an H200 with CUDA graphs both models' steps cost about the same fixed
    floor, so it decoded at 0.87-0.96x of no draft (BENCHMARKS.md). It stays available for its
    statistics and for testing; a real draft for a large target is a user's choice."""
    if draft is None or draft.lower() == "none":
        return None
    if draft.lower() == "bundled":
        bundled = bundled_model("draft")
        if not (bundled / "config.json").is_file():
            raise typer.BadParameter(f"the bundled draft is not installed ({bundled})", param_hint="--draft")
        return str(bundled)
    return draft


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _path(value: str) -> Path:
    """A path option or argument: an empty one is refused (Path("") is the current folder, which
    `docproc run "$INBOX"` with the variable unset does not mean)."""
    if isinstance(value, str) and not value:
        raise typer.BadParameter("an empty path (an unset shell variable?): name a file or folder")
    return Path(value)


@app.command(cls=_Command)
def run(
    inputs: list[Path] = typer.Argument(..., metavar="INPUTS", parser=_path, help="Files or folders (searched recursively)."),
    out: Path = typer.Option(..., "--out", "-o", metavar="DIR", parser=_path, help="Output folder (results.parquet, json/, runs/)."),
    queries: Optional[Path] = typer.Option(None, "--queries", metavar="FILE", parser=_path, help="Query set (TOML). Default: the bundled "
                                                                     "invoice/receipt set."),
    model: Optional[str] = typer.Option(None, "--model", metavar="DIR", help="Model folder. Default: the bundled target model."),
    draft: Optional[str] = typer.Option(None, "--draft", metavar="DIR", help="Draft model folder for speculative decoding, "
                                                                 "'bundled' (the bundled draft) or 'none' (the default)."),
    spec_k: Optional[str] = typer.Option(None, "--spec-k", metavar="K", help="With --draft: draft tokens per step, a "
                                         "number, or auto (adaptive; the default)."),
    draft_vision: Optional[str] = typer.Option(None, "--draft-vision", metavar="MODE", help="With --draft: auto (the "
                                               "default), own or none (the draft sees text only)."),
    kv_cache: str = typer.Option("auto", "--kv-cache", metavar="FORMAT", help="KV cache format: auto, bf16, fp16, "
                                                                               "fp32 or fp4."),
    quantization: Optional[str] = typer.Option(None, "--quantization", metavar="fp8", help="Quantize the model's "
                                               "language weights to FP8 at load (half the weight bytes; an FP8 "
                                               "checkpoint needs no flag)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", metavar="N", help="Split the model's "
                                             "language weights over N GPUs (cuda:K to K+N-1), one process each; "
                                             "a draft runs whole on the first."),
    device: str = typer.Option("auto", "--device", metavar="DEVICE", help="auto, cpu, cuda or cuda:K."),
    dpi: int = typer.Option(120, "--dpi", metavar="N", help="PDF render resolution (lowered per page to fit the pixel cap)."),
    max_pages: Optional[int] = typer.Option(None, "--max-pages", metavar="N", help="Read at most N pages per "
                                                                                    "document."),
    format: str = typer.Option("json,parquet", "--format", metavar="LIST", help="Outputs, comma-separated: json "
                               "(json/PATH.json), parquet, csv, jsonl (results.parquet, .csv, .jsonl: the same "
                               "rows) and documents (documents.parquet, and .csv/.jsonl with csv/jsonl: a row per "
                               "document, typed)."),
    force: bool = typer.Option(False, "--force", help="Redo documents already done with the same settings."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what a run would do to each document and why "
                                 "(new, redo, already done, moved, removed, skipped) and write nothing; the model "
                                 "loads only where the configuration fingerprint is not cached and an outcome "
                                 "turns on it."),
    max_num_batched_tokens: int = typer.Option(8192, "--max-num-batched-tokens", metavar="N",
                                               help="Engine token budget per step."),
    gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization", metavar="FRACTION",
                                                 help="Share of GPU memory to use."),
    batch_pages: Optional[int] = typer.Option(None, "--batch-pages", metavar="N", help="Pages rendered ahead of the "
                                              "engine and not yet answered (bounds memory and what a kill can lose; "
                                              "each render process may hold one window more). Default: 128 with a "
                                              "GPU, 32 on a CPU."),
    load_format: str = typer.Option("auto", "--load-format", hidden=True, help="dummy: random weights from "
                                    "config.json alone (benchmarks at sizes no disk holds; answers are noise)."),
    fp4_value_slots: Optional[int] = typer.Option(None, "--fp4-value-slots", hidden=True, help="Removed: FP4 values "
                                                  "have no outlier slots. 0 is accepted, with a warning."),
    render_workers: Optional[int] = typer.Option(None, "--render-workers", metavar="N", help="Processes that render "
                                                 "pages ahead of the engine (default: with a GPU a quarter of the "
                                                 "cores, 1 to 4; on a CPU 0: a thread of the run's own process)."),
    anchor_text: bool = typer.Option(False, "--anchor-text", help="Put each PDF page's own text layer, with "
                                     "coordinates, in the prompt beside its image (scans have none)."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="No CUDA graphs for decode and "
                                       "verification steps (debugging, profiling)."),
    batch_invariant: bool = typer.Option(False, "--batch-invariant", help="Answers that do not depend on the "
                                         "batch: a document gives the answers it gives alone, whatever runs "
                                         "beside it (one GPU's kernels with one summation order; slower)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display and no summary."),
    debug: bool = typer.Option(False, "--debug", help="Print the traceback of every unexpected error (a "
                               "document's, or the run's) on stderr."),
    log_json: bool = typer.Option(False, "--log-json", help="JSON lines (one per document, then the manifest) on stdout."),
    ray: bool = typer.Option(False, "--ray", help="Spread the documents over engine actors on a Ray cluster (one "
                             "per GPU): a local cluster, or the one at --ray-address. pip install 'docproc[ray]'."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", metavar="ADDRESS", help="With --ray: an "
                                              "existing cluster (auto, HOST:6379 or ray://HOST:10001)."),
    data_parallel_size: Optional[int] = typer.Option(None, "--data-parallel-size", metavar="N", help="With --ray: "
                                                     "engine actors (default: the cluster's GPUs, or 1 on CPU)."),
) -> None:
    """Extract fields from every document under INPUTS into OUT.

    Example: docproc run invoices/ scans/ --out out --kv-cache fp4
    """
    from docproc.errors import EnvironmentFault
    from docproc.pipeline.queries import QueryFileError
    from docproc.pipeline.run import Pipeline, RunSettings
    from docproc.pipeline.runstore import LockedError

    try:
        draft_dir = resolve_draft(draft)
        if spec_k is not None and draft_dir is None:  # as vLLM: no speculative tokens without a draft
            raise typer.BadParameter("--spec-k goes with --draft (it counts the draft's tokens per step): add "
                                     "--draft DIR (or bundled), or leave --spec-k out", param_hint="--spec-k")
        if fp4_value_slots is not None:  # removed: a cron line that spelled out the default keeps working
            if fp4_value_slots != 0:
                raise typer.BadParameter(f"--fp4-value-slots {fp4_value_slots}: FP4 values have no outlier slots any "
                                         f"more (two bought no accuracy); leave the option out",
                                         param_hint="--fp4-value-slots")
            error("--fp4-value-slots 0 is what every FP4 run does now: the option is going; leave it out", "warning",
                  "yellow")
        if draft_vision is not None and draft_dir is None:
            raise typer.BadParameter("--draft-vision goes with --draft (it says how the draft sees the pages): add "
                                     "--draft DIR (or bundled), or leave --draft-vision out",
                                     param_hint="--draft-vision")
        settings = RunSettings(inputs=[str(p) for p in inputs], out=str(out), model=resolve_model(model),
                               draft=draft_dir, spec_k=spec_k or "auto", draft_vision=draft_vision or "auto",
                               queries=str(queries) if queries else None, device=device, kv_cache=kv_cache, dpi=dpi,
                               max_pages=max_pages, formats=parse_formats(format), force=force,
                               max_num_batched_tokens=max_num_batched_tokens,
                               gpu_memory_utilization=gpu_memory_utilization, batch_pages=batch_pages,
                               render_workers=render_workers, load_format=load_format,
                               anchor_text=anchor_text, enforce_eager=enforce_eager,
                               batch_invariant=batch_invariant, quantization=quantization, debug=debug,
                               ray=ray, ray_address=ray_address, data_parallel_size=data_parallel_size,
                               tensor_parallel_size=tensor_parallel_size)
        display = _Display(quiet=quiet or log_json, log_json=log_json)
        if ray:
            from docproc.pipeline.distributed import RayPipeline

            pipeline = RayPipeline(settings, reporter=display)
        else:
            pipeline = Pipeline(settings, reporter=display)
    except (QueryFileError, ValueError, typer.BadParameter) as e:
        error(e)
        raise typer.Exit(EXIT_USAGE)
    if dry_run:
        _dry_run(pipeline, log_json, debug)
    if not ray:  # a Ray run's devices are its actors'
        display.watch_device(gpu_only_options(settings),
                             lambda: pipeline.llm.cache_info()["device"] if pipeline.llm is not None else None)
    try:
        manifest = pipeline.run()
    except LockedError as e:
        error(f"{e}; exiting", "locked", "yellow")
        raise typer.Exit(EXIT_LOCKED)
    except EnvironmentFault as e:  # before the run started (the output folder): no manifest
        error(e)
        raise typer.Exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 -- a bug: one line, the traceback with --debug
        _internal_error(e, debug)
    finally:
        pipeline.report.close()
        pipeline.close_engine()
    failed = manifest["status"] == "failed"
    try:
        if log_json:
            print(json.dumps({"event": "end", **manifest}), flush=True)
        elif not quiet and not failed:  # a fault is told in one line (its manifest holds the figures)
            _summary(manifest)
    except BrokenPipeError:  # stdout closed (`| head`): the run is done and recorded all the same
        _stdout_gone()
    if failed:
        # an unwritable OUT loses the rows in flight: the documents written before it are counted
        fault = manifest["fault"]
        kept = manifest["totals"]["documents"] if fault["kind"] != "output" else fault.get("documents_kept") or 0
        error(manifest["fault"]["message"] + (f"; the {kept} document(s) finished before it are kept: run the "
                                              f"same command again to finish" if kept else ""))
    elif manifest["status"] == "interrupted":
        t = manifest["totals"]
        moved = f" ({t['moved']} renamed file(s) moved)" if t.get("moved") else ""
        error(f"{manifest['fault']['message']}: {t['documents']} documents finished and kept{moved}; the batch in "
              f"flight was dropped; run the same command again to finish", "interrupted", "yellow")
    global _run_ended
    _run_ended = not ray  # (a Ray run leaves its cluster through Ray's own exit handlers)
    raise typer.Exit(manifest["exit_code"])


# `docproc run` ended: its outputs are written and closed, its render processes and the engine's
# ranks stopped (entry() then leaves without Python's teardown)
_run_ended = False


def _leave(code: int | None) -> None:
    """End the process at once, its output flushed. Python's teardown after a run (collecting the
    model and the libraries' objects, their static destructors, CUDA's context) took about 1 s of
    every `docproc run`, the runs of a cron job included; the kernel frees all of it. Not under a
    tracer, a profiler or coverage (they save what they gathered at exit). multiprocessing's exit
    work runs first: its queues' and locks' finalizers (else its resource tracker reports them
    leaked on stderr)."""
    if sys.gettrace() is not None or sys.getprofile() is not None or "coverage" in sys.modules:
        return
    mp = sys.modules.get("multiprocessing.util")
    if mp is not None:
        try:
            mp._exit_function()
        except Exception:  # noqa: BLE001 -- (another Python's internals): the ordinary exit then
            return
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # (started with that descriptor closed: `docproc run ... >&-`)
            continue
        try:
            stream.flush()
        except (OSError, ValueError):  # (closed, or a pipe whose reader left)
            pass
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


def _internal_error(e: Exception, debug: bool) -> None:
    """A bug of docproc's: one line and exit 70, or (--debug) the exception with its traceback."""
    if debug:
        raise e
    error(f"internal error: {type(e).__name__}: {e} (run again with --debug for the traceback, and please "
          f"report it)")
    raise typer.Exit(EXIT_INTERNAL)


def _dry_run(pipeline, log_json: bool, debug: bool) -> None:
    """Print the plan of the run (docproc.pipeline.plan) and exit 0; a fault exits as the run would."""
    from docproc.errors import EnvironmentFault
    from docproc.pipeline.plan import ACTIONS, dry_run

    try:
        plan = dry_run(pipeline)
    except EnvironmentFault as e:
        error(e)
        raise typer.Exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 -- a bug: one line, the traceback with --debug
        _internal_error(e, debug)
    finally:
        pipeline.report.close()
        pipeline.close_engine()
        if getattr(pipeline, "_started_ray", False):  # a Ray run's fingerprint came from a worker
            import ray

            ray.shutdown()
    c, f = plan["counts"], plan["fingerprint"]
    try:
        if log_json:
            for d in plan["documents"]:
                print(json.dumps({"event": "plan", **d}))
            print(json.dumps({"event": "plan_end", "counts": c, "json_missing": plan["json_missing"],
                              "stray_files": plan["stray_files"], "config_fingerprint": plan["config_fingerprint"],
                              "fingerprint": f}), flush=True)
        else:
            table = Table(box=None, pad_edge=False)
            for col in ("action", "path", "reason"):
                table.add_column(col, overflow="fold")
            for d in plan["documents"]:
                table.add_row(d["action"], escape(shown(d["path"])), escape(d["reason"] or ""))
            if plan["documents"]:
                out_console.print(table)
            out_console.print(escape(
                f"would process {c['new'] + c['redo']} (new {c['new']}, redo {c['redo']}); "
                + ", ".join(f"{'errors' if a == 'error' else a} {c[a]}" for a in ACTIONS[2:])
                + (f"; would write {plan['json_missing']} document JSON file(s) missing from OUT/json from "
                   f"their rows" if plan["json_missing"] else "")
                + (f"; would remove {plan['stray_files']} file(s) an interrupted run left" if plan["stray_files"] else "")
                + f". Configuration fingerprint {plan['config_fingerprint'] or '-'}, {f['why']}. Nothing was "
                  f"written."), soft_wrap=True)
    except BrokenPipeError:  # stdout closed (`| head`)
        _stdout_gone()
    raise typer.Exit(EXIT_OK)


def gpu_only_options(settings) -> list[str]:
    """The options set that are meant for CUDA: on a CPU they run the torch reference code, and the
    run is slower with them than without."""
    return [flag for flag, on in (("--kv-cache fp4", settings.kv_cache == "fp4"),
                                  ("--quantization fp8", settings.quantization == "fp8"),
                                  ("--draft", settings.draft is not None),
                                  ("--batch-invariant", settings.batch_invariant)) if on]


def cpu_warning(flags: list[str]) -> str:
    one = len(flags) == 1
    return (f"{' and '.join(flags)} {'is' if one else 'are'} meant for CUDA: on a CPU {'it runs' if one else 'they run'} "
            f"the torch reference code, slower than without {'it' if one else 'them'}"
            + ("; --batch-invariant's products there are torch's, whose sums may follow the row count"
               if "--batch-invariant" in flags else ""))


# Off a terminal (cron mail, a log file) the progress is one plain line this often, and at the
# end: a stall shows within half a minute, and a two-hour run writes 240 short lines, not a flood.
LINE_SECONDS = 30.0


class _Display:
    """Progress on stderr while a run goes, moved by the pipeline's events as things happen: the
    model load, each page rendered, each request answered (tokens/s and draft acceptance with it),
    each document. On a terminal a Rich bar; elsewhere one plain line every LINE_SECONDS and one
    at the end (no ANSI codes). Warnings show even when quiet (--quiet, --log-json)."""

    def __init__(self, quiet: bool, log_json: bool, console: Console | None = None, clock=None,
                 line_seconds: float = LINE_SECONDS, tick_seconds: float | None = 5.0) -> None:
        """console: where progress goes (default: stderr's); clock: seconds, monotonic (a test's
        fake); tick_seconds: how often a background thread looks whether a plain line is due (None:
        only as events come)."""
        import time

        self.quiet, self.log_json = quiet, log_json
        self._console = console
        self.clock = clock or time.monotonic
        self.line_seconds, self.tick_seconds = line_seconds, tick_seconds
        self.progress = None
        self.task = None
        self.gpu_flags: list[str] = []
        self.engine_device = lambda: None
        self.files: int | None = None
        self.documents = self.pages = self.answered = self.submitted = self.tokens = 0
        self.proposed = self.accepted = 0
        self.engine_seconds = 0.0
        self.loading = False
        self.live = False  # the engine's figures come as each request finishes (not with --ray)
        self.t0: float | None = None  # the first event's time: the run's elapsed seconds count from it
        self.last_line: float | None = None
        self._lock = None
        self._stop = None

    @property
    def console(self) -> Console:
        return self._console or err_console

    def watch_device(self, gpu_flags: list[str], engine_device) -> None:
        """Warn once, when the engine has loaded on a CPU, about gpu_flags (gpu_only_options).
        engine_device() is the loaded engine's device, None before it loads: an engine that never
        loads (nothing to do, a model that fails to) gets no warning."""
        self.gpu_flags, self.engine_device = gpu_flags, engine_device

    def __call__(self, event: str, data: dict) -> None:
        if self.log_json and event == "document":
            print(json.dumps({"event": "document", **data}), flush=True)
        if event == "warning":  # shown even with --quiet
            error(data["message"], "warning", "yellow")
        if self.gpu_flags and event in ("start", "batch", "load_end"):
            device = self.engine_device()
            if device is not None:
                if device == "cpu":
                    error(cpu_warning(self.gpu_flags), "warning", "yellow")
                self.gpu_flags = []
        if self.quiet:
            return
        if event == "note":
            self.console.print(f"docproc: {data['message']}", markup=False, highlight=False, soft_wrap=True)
            return
        if event == "end" and (self.t0 is None or data.get("status") == "failed"):
            return  # nothing was shown yet, or the run failed: its one line says it all
        if not self._take(event, data):
            return
        if self.t0 is None:
            self.t0 = self.clock()
            self._begin()
        if self.progress is not None:
            self.progress.update(self.task, description="loading model" if self.loading else "documents",
                                 total=self.files, completed=self.documents, info=self.figures(bar=True))
        elif event == "load_end":
            self._line(f"docproc: model loaded in {data['seconds']:.1f} s")
        else:
            self._line(self.line() if event == "end" else None)

    def _take(self, event: str, data: dict) -> bool:
        """Update the figures from an event; False for an event that moves nothing shown."""
        if event == "start":
            self.files = data["files"]
        elif event == "load_start":
            self.loading = True
        elif event == "load_end":
            self.loading = False
        elif event == "document":
            self.documents += 1
        elif event == "page":
            self.pages = data["pages"]
        elif event == "requests":  # cumulative figures, at submission and as each request finishes
            self.live = True
            self.answered, self.submitted, self.tokens = data["answered"], data["submitted"], data["generated_tokens"]
            self.proposed, self.accepted = data["draft_proposed"], data["draft_accepted"]
            self.engine_seconds = data["engine_seconds"]
        elif event == "batch":
            t = data["totals"]
            self.pages = max(self.pages, t["pages"])
            if not self.live:  # a --ray run's driver: its figures come with each batch a worker ends
                self.answered = self.submitted = t["requests"]
                self.tokens, self.proposed, self.accepted = t["generated_tokens"], t["draft_proposed"], t["draft_accepted"]
                self.engine_seconds = data["engine_seconds"]
        elif event != "end":
            return False
        return True

    def figures(self, bar: bool = False) -> str:
        """Pages, requests, tokens/s and acceptance (with bar=False, documents and seconds too)."""
        rate = self.tokens / self.engine_seconds if self.engine_seconds > 0 else None
        tps = "-" if rate is None else f"{rate:.1f}" if rate < 10 else f"{rate:.0f}"  # a small model on a CPU: 0.4
        acc = f"{self.accepted / self.proposed:.0%}" if self.proposed else "-"
        if bar:
            return f"pages {self.pages}  requests {self.answered}/{self.submitted}  {tps} tok/s  acceptance {acc}"
        files = "?" if self.files is None else self.files
        elapsed = self.clock() - self.t0 if self.t0 is not None else 0.0
        return (f"{self.documents}/{files} documents, {self.pages} pages, {self.answered}/{self.submitted} requests, "
                f"{tps} tok/s, acceptance {acc}, {elapsed:.0f} s")

    def line(self) -> str:
        return "docproc: " + ("loading model, " if self.loading else "") + self.figures()

    def _begin(self) -> None:
        import threading

        if self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=self.console,
                                     transient=True, refresh_per_second=4)
            self.task = self.progress.add_task("loading model" if self.loading else "documents", total=self.files,
                                               info=self.figures(bar=True))
            self.progress.start()
            return
        self.last_line = self.t0
        self._lock = threading.Lock()
        if self.tick_seconds is not None:  # a line is due during a long load or request too
            self._stop = threading.Event()
            threading.Thread(target=self._ticker, name="docproc-progress", daemon=True).start()

    def _ticker(self) -> None:
        while not self._stop.wait(self.tick_seconds):
            try:
                self._line_if_due()
            except Exception:  # noqa: BLE001 -- display only: a closed stderr ends the lines, not the run
                return

    def _line_if_due(self) -> None:
        self._line(None)

    def _line(self, text: str | None) -> None:
        """Write text, or (None) the progress line when one is due; events and the ticker both
        come here, one at a time."""
        with self._lock:
            if text is None:
                if self.clock() - self.last_line < self.line_seconds:
                    return
                text = self.line()
            self.last_line = self.clock()
            self.console.file.write(text + "\n")  # plain: no markup, no wrapping, no ANSI codes
            self.console.file.flush()

    def close(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self.progress:
            self.progress.stop()


def _summary(m: dict) -> None:
    t = m["totals"]
    out_console.print(f"[bold]docproc run {m['run_id']}[/bold]  {m['seconds']:.1f} s  -> {escape(m['settings']['out'])}")
    table = Table(show_header=False, box=None, pad_edge=False)
    rows = [
        ("files", f"{t['files']}  (ok {t['ok']}, partial {t['partial']}, errors {t['errors']}, skipped {t['skipped']}, "
                  f"already done {t['already_done']}, moved {t['moved']}; removed {t['removed']})"),
        ("pages", f"{t['pages']}  (unique {t['unique_pages']}; vision encodes {_fmt(m['dedup']['vision_encodes'])})"),
        ("requests", f"{t['requests']}  prompt tokens {t['prompt_tokens']} (from cache {t['cached_tokens']})"),
        ("generated", f"{t['generated_tokens']} tokens, {_fmt(m['tokens_per_second'])} tok/s"),
        ("draft acceptance", _fmt(m["acceptance_rate"])),
        ("stages (s)", "  ".join(f"{k} {v}" for k, v in m["stage_seconds"].items())),
        ("model", f"{m['model']['path']} (text {m['model'].get('text', '-')}, vision {m['model'].get('vision', '-')})"),
        ("kv cache", f"{m['engine'].get('kv_cache_dtype')} on {m['engine'].get('device')}" if m.get("engine")
         else "model not loaded (nothing to do)"),
        ("draft", "none" if not m.get("draft") else
         f"{m['draft']['draft_model']} (k max {m['draft']['k_max']}{', adaptive' if m['draft']['adaptive'] else ''}; "
         f"mean accepted {_fmt(m['draft']['mean_accepted_length'])}, bypassed steps {m['draft']['bypassed_steps']})"),
    ]
    for k, v in rows:
        table.add_row(f"[dim]{k}[/dim]", escape(v))
    out_console.print(table)
    failed = m.get("failures") or []
    if failed:
        out_console.print(f"[red]failed[/red] {t['errors']} file(s):")
        for f in failed[:FAILURES_SHOWN]:
            out_console.print(f"  {escape(shown(f['path']))}: {escape(str(f['error']))} [dim]({f['kind']})[/dim]",
                              soft_wrap=True)
        if t["errors"] > FAILURES_SHOWN:
            out_console.print(f"  ... and {t['errors'] - FAILURES_SHOWN} more: "
                              f"docproc stats {escape(m['settings']['out'])} --failures")


# the engine options of run-batch and serve
MODEL_OPT = typer.Option(None, "--model", help="Local checkpoint folder. Default: the bundled model.")
DRAFT_OPT = typer.Option(None, "--draft", help="Draft model folder for speculative decoding, or bundled.")
SPEC_K_OPT = typer.Option("auto", "--spec-k", help="With --draft: draft tokens per step, a number or auto.")
KV_CACHE_OPT = typer.Option("auto", "--kv-cache", help="KV cache format: auto, bf16, fp16, fp32 or fp4.")
QUANTIZATION_OPT = typer.Option(None, "--quantization", help="fp8: the language weights in FP8.")
DEVICE_OPT = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N.")
GPU_UTIL_OPT = typer.Option(0.9, "--gpu-memory-utilization", help="Share of the GPU.")
BATCHED_TOKENS_OPT = typer.Option(8192, "--max-num-batched-tokens", help="Tokens per engine step.")
SEED_OPT = typer.Option(0, "--seed", help="The engine's seed (a body's seed is per request).")
BATCH_INVARIANT_OPT = typer.Option(False, "--batch-invariant", help="Greedy answers that do not depend on the "
                                   "requests beside them (one GPU; slower; sampled ones still do).")
STREAM_INTERVAL_MS = 0.0  # serve: least time between a stream's chunks


def _spec_k(spec_k: str) -> int | str:
    """--spec-k: a number >= 1 or auto (exit 2 otherwise)."""
    if spec_k == "auto":
        return spec_k
    if not spec_k.isdigit() or int(spec_k) < 1:
        error(f"--spec-k must be a number >= 1 or auto, got {spec_k!r}", "usage")
        raise typer.Exit(EXIT_USAGE)
    return int(spec_k)


def _model_dirs(model: Optional[str], draft: Optional[str]) -> tuple[str, Optional[str]]:
    try:
        return resolve_model(model), resolve_draft(draft)
    except typer.BadParameter as e:
        error(str(e), "usage")
        raise typer.Exit(EXIT_USAGE) from None


def _load_llm(model_dir: str, draft_dir: Optional[str], on_fail=None, **engine):
    """The engine for run-batch and serve; a model or device that fails is one line and its exit
    code (on_fail runs first)."""
    from docproc import LLM
    from docproc.errors import DeviceUnavailable, ModelUnavailable

    try:
        return LLM(model_dir, speculative_model=draft_dir, **engine)
    except DeviceUnavailable as e:
        if on_fail is not None:
            on_fail()
        error(str(e))
        raise typer.Exit(EXIT_DEVICE) from None
    except (ModelUnavailable, ValueError, RuntimeError, OSError) as e:
        if on_fail is not None:
            on_fail()
        error(f"cannot load {model_dir}{f' with draft {draft_dir}' if draft_dir else ''}: {e}")
        raise typer.Exit(EXIT_MODEL) from None
    except BaseException:  # a signal while it loads (its handler's exception), anything else: on_fail too
        if on_fail is not None:
            on_fail()
        raise


@app.command("run-batch", cls=_Command)
def run_batch_cmd(
    input_file: Path = typer.Option(..., "-i", "--input", parser=_path, help="OpenAI batch file: JSONL of {custom_id, method, "
                                    "url, body}, url /v1/chat/completions or /v1/completions; - reads standard input."),
    output_file: Path = typer.Option(..., "-o", "--output", parser=_path, help="Results JSONL (appended to: a rerun answers only "
                                     "the custom_ids it does not hold)."),
    model: Optional[str] = MODEL_OPT,
    draft: Optional[str] = DRAFT_OPT,
    spec_k: str = SPEC_K_OPT,
    kv_cache: str = KV_CACHE_OPT,
    quantization: Optional[str] = QUANTIZATION_OPT,
    device: str = DEVICE_OPT,
    gpu_memory_utilization: float = GPU_UTIL_OPT,
    max_num_batched_tokens: int = BATCHED_TOKENS_OPT,
    image_root: Optional[Path] = typer.Option(None, "--image-root", parser=_path, help="Local images and PDFs named in the file "
                                              "are read from under this folder only (data: URLs always work)."),
    seed: int = SEED_OPT,
    batch_invariant: bool = BATCH_INVARIANT_OPT,
    quiet: bool = typer.Option(False, "--quiet", help="Only errors and the summary line."),
) -> None:
    """Answer an OpenAI batch file with the engine (crash-safe, resumable; see README)."""
    from docproc.errors import DeviceUnavailable, OutputUnwritable
    from docproc.openai_compat.batch import STDIN_NAMES, NotResults, OutputFile, run_batch
    from docproc.openai_compat.protocol import Limits
    from docproc.pipeline.runstore import LockedError

    stdin = str(input_file) in STDIN_NAMES
    input_stat = None
    if stdin:
        try:
            input_stat = os.fstat(sys.stdin.fileno())
            write_only = fcntl.fcntl(sys.stdin.fileno(), fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY
        except io.UnsupportedOperation:
            write_only = False  # (a stream without a descriptor: a caller's own)
        except (AttributeError, OSError, ValueError):  # (closed: `<&-`)
            error(f"--input {input_file}: standard input is closed", "usage")
            raise typer.Exit(EXIT_USAGE)
        if write_only:  # (`0>file`: the model would load before the first read failed)
            error(f"--input {input_file}: standard input is open for writing only", "usage")
            raise typer.Exit(EXIT_USAGE)
    else:  # (a file, or a pipe: /dev/stdin, <(cmd), a FIFO; read once, in order)
        if input_file.is_dir():
            error(f"--input {input_file} is a folder: name the batch file (or - for standard input)", "usage")
            raise typer.Exit(EXIT_USAGE)
        if not input_file.exists():
            error(f"--input {input_file} does not exist", "usage")
            raise typer.Exit(EXIT_USAGE)
        if not (input_file.is_file() or input_file.is_fifo() or input_file.is_char_device()):
            error(f"--input {input_file} is not a file", "usage")
            raise typer.Exit(EXIT_USAGE)
        try:  # (a FIFO is not opened here: a writer waiting for its reader would take this one for it)
            if input_file.is_fifo():
                input_stat = os.stat(input_file)
                if not os.access(input_file, os.R_OK):
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
            else:
                fd = os.open(input_file, os.O_RDONLY | os.O_NONBLOCK)
                input_stat = os.fstat(fd)
                os.close(fd)
        except OSError as e:
            error(f"--input {input_file} cannot be read: {e.strerror}", "usage")
            raise typer.Exit(EXIT_USAGE)
    if image_root is not None and not image_root.is_dir():
        error(f"--image-root {image_root} is not a folder", "usage")
        raise typer.Exit(EXIT_USAGE)
    if str(output_file) == "-":
        error("--output - is not served: results go to a file (a rerun reads it to answer only the rest)", "usage")
        raise typer.Exit(EXIT_USAGE)
    if output_file.exists() and not output_file.is_file():
        error(f"--output {output_file} is not a regular file", "usage")
        raise typer.Exit(EXIT_USAGE)
    if output_file.exists() and input_stat is not None and os.path.samestat(os.stat(output_file), input_stat):
        # (read while lines are appended to it, it would never end)
        error("--output is the --input file: results go to a file of their own", "usage")
        raise typer.Exit(EXIT_USAGE)
    k = _spec_k(spec_k)
    model_dir, draft_dir = _model_dirs(model, draft)
    out = OutputFile(output_file)
    try:  # the lock and the output's lines before the model loads
        out.open()
    except LockedError as e:
        error(f"{e}; exiting", "locked", "yellow")
        raise typer.Exit(EXIT_LOCKED) from None
    except NotResults as e:
        error(str(e), "usage")
        raise typer.Exit(EXIT_USAGE) from None
    except OutputUnwritable as e:
        error(str(e))
        raise typer.Exit(EXIT_OUTPUT) from None
    llm = _load_llm(model_dir, draft_dir, on_fail=out.abandon, device=device, kv_cache_dtype=kv_cache,
                    quantization=quantization, num_speculative_tokens=k, seed=seed,
                    gpu_memory_utilization=gpu_memory_utilization, max_num_batched_tokens=max_num_batched_tokens,
                    batch_invariant=batch_invariant)
    name = Path(model_dir).name
    from docproc.pipeline.signals import EXIT_INTERRUPTED, RunInterrupted

    try:
        summary = run_batch(input_file, out, llm, name, Limits(image_root=image_root))
    except (KeyboardInterrupt, RunInterrupted) as e:
        import signal

        signum = getattr(e, "signum", signal.SIGINT)
        error(f"stopped by {signal.Signals(signum).name}: the lines written are kept; run the same command again "
              f"to answer the rest", "interrupted", "yellow")
        raise typer.Exit(EXIT_INTERRUPTED[signum]) from None
    except (OutputUnwritable, DeviceUnavailable) as e:  # (the environment's faults: one line, their exit code)
        error(str(e))
        raise typer.Exit(e.exit_code) from None
    except Exception as e:  # noqa: BLE001 - a bug: one line (the lines written are kept), exit 70
        error(f"{type(e).__name__}: {e} (the lines written are kept)", "internal error")
        raise typer.Exit(EXIT_INTERNAL) from None
    finally:
        out.close()
        llm.close()
    s = summary
    tok_s = s.completion_tokens / s.seconds if s.seconds > 0 else 0.0
    spec = llm.spec_info()
    line = (f"docproc run-batch {s.lines} lines: answered {s.answered}, errors {s.errors}, already done "
            f"{s.already_done}, duplicate custom_ids skipped {s.duplicates}; {s.completion_tokens} tokens, "
            f"{_fmt(tok_s)} tok/s in {s.seconds:.1f} s"
            + (f"; draft acceptance {_fmt(spec.get('acceptance_rate'))}" if spec else "") + f" -> {output_file}")
    out_console.print(escape(line), soft_wrap=True)
    if s.other_models and not quiet:
        error(f"bodies name other models ({', '.join(s.other_models[:3])}); every line was answered by {name}",
              "note", "yellow")
    raise typer.Exit(EXIT_FAILURES if s.errors else EXIT_OK)


@app.command("serve", cls=_Command)
def serve_cmd(
    model: Optional[str] = MODEL_OPT,
    draft: Optional[str] = DRAFT_OPT,
    spec_k: str = SPEC_K_OPT,
    kv_cache: str = KV_CACHE_OPT,
    quantization: Optional[str] = QUANTIZATION_OPT,
    device: str = DEVICE_OPT,
    gpu_memory_utilization: float = GPU_UTIL_OPT,
    max_num_batched_tokens: int = BATCHED_TOKENS_OPT,
    seed: int = SEED_OPT,
    batch_invariant: bool = BATCH_INVARIANT_OPT,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free port, printed at start)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="DOCPROC_API_KEY",
                                          help="Require Authorization: Bearer KEY on /v1 (or set DOCPROC_API_KEY)."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="The model's name in /v1/models and answers. Default: "
                                                    "the model folder's name."),
    image_root: Optional[Path] = typer.Option(None, "--image-root", parser=_path, help="Requests may name local images and PDFs "
                                              "(file:// URLs, paths) under this folder; without it only data: URLs."),
    max_request_mb: float = typer.Option(32.0, "--max-request-mb", help="Largest request body, in MiB."),
    max_images: int = typer.Option(16, "--max-images", help="Most images in one request (a PDF's pages count)."),
    stream_interval_ms: float = typer.Option(
        STREAM_INTERVAL_MS, "--stream-interval-ms",
        help="Least time between a stream's chunks, in ms (0: a chunk after every engine step). A stream's first "
        "token is sent at once; a chunk then carries every token since the last."),
    log_level: str = typer.Option("warning", "--log-level", help="The HTTP server's log: warning, info or debug."),
) -> None:
    """Serve the model over OpenAI's HTTP API: /v1/chat/completions (streaming or not),
    /v1/completions, /v1/models, /health, /metrics. Ctrl-C or SIGTERM lets the requests in
    flight finish, then stops (a second one stops at once)."""
    import importlib.util
    import socket

    if importlib.util.find_spec("starlette") is None or importlib.util.find_spec("uvicorn") is None:
        error("docproc serve needs its HTTP extra: pip install 'docproc[serve]'", "usage")
        raise typer.Exit(EXIT_USAGE) from None
    from docproc.openai_compat.protocol import Limits
    from docproc.openai_compat.server import ServerConfig, serve

    k = _spec_k(spec_k)
    if not 0 <= port <= 65535:
        error(f"--port must be 0-65535, got {port}", "usage")
        raise typer.Exit(EXIT_USAGE)
    if image_root is not None and not image_root.is_dir():
        error(f"--image-root {image_root} is not a folder", "usage")
        raise typer.Exit(EXIT_USAGE)
    if not 0.01 <= max_request_mb <= 1024:  # (nan is neither; the server holds at most 1 GiB of bodies)
        error(f"--max-request-mb must be a number from 0.01 to 1024, got {max_request_mb}", "usage")
        raise typer.Exit(EXIT_USAGE)
    if not 1 <= max_images <= 1024:
        error(f"--max-images must be 1-1024, got {max_images}", "usage")
        raise typer.Exit(EXIT_USAGE)
    if not 0 <= stream_interval_ms <= 10_000:  # (nan is neither)
        error(f"--stream-interval-ms must be a number from 0 to 10000, got {stream_interval_ms}", "usage")
        raise typer.Exit(EXIT_USAGE)
    if not host.strip():
        error("--host is empty: name an address (127.0.0.1, or 0.0.0.0 for every interface)", "usage")
        raise typer.Exit(EXIT_USAGE)
    if log_level not in ("warning", "info", "debug"):
        error(f"--log-level must be warning, info or debug, got {log_level!r}", "usage")
        raise typer.Exit(EXIT_USAGE)
    if api_key is None and os.environ.get("DOCPROC_API_KEY") is not None:
        api_key = os.environ["DOCPROC_API_KEY"]  # (an empty one reads as unset: it is refused below)
    if api_key is not None:
        api_key = api_key.strip()  # (a header's value is; a key file's newline is not part of it)
        if not api_key:
            error("the API key (--api-key or DOCPROC_API_KEY) is empty: give a key, or unset it to serve "
                  "without one", "usage")
            raise typer.Exit(EXIT_USAGE)
    model_dir, draft_dir = _model_dirs(model, draft)
    # the address first: a port in use is found before the model loads
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # connections made while the model loads wait for it
    except OSError as e:
        error(f"cannot listen on {host}:{port}: {e.strerror or e} (pick another --port or --host)", "usage")
        raise typer.Exit(EXIT_USAGE) from None
    llm = _load_llm(model_dir, draft_dir, on_fail=sock.close, device=device, kv_cache_dtype=kv_cache,
                    quantization=quantization, num_speculative_tokens=k, seed=seed,
                    gpu_memory_utilization=gpu_memory_utilization, max_num_batched_tokens=max_num_batched_tokens,
                    batch_invariant=batch_invariant)
    name = served_model_name or Path(model_dir).name
    cfg = ServerConfig(name, Limits(image_root=image_root, max_images=max_images,
                                    max_bytes=int(max_request_mb * (1 << 20))),
                       api_key=api_key, max_request_bytes=int(max_request_mb * (1 << 20)),
                       max_model_len=llm.max_model_len, stream_interval=stream_interval_ms / 1000)
    where = sock.getsockname()
    shown_host = f"[{where[0]}]" if family == socket.AF_INET6 else where[0]
    out_console.print(escape(f"docproc serve: {name} at http://{shown_host}:{where[1]}/v1 "
                             f"(Ctrl-C or SIGTERM stops after the requests in flight)"), soft_wrap=True)
    sys.stdout.flush()
    try:
        code = serve(llm, cfg, sock, log_level)
    finally:
        llm.close()
    raise typer.Exit(code)


def _reading_error(e: Exception, out: Path) -> str:
    """stats' and eval's one line for what stopped them: our own message, or the system's
    refusal with the path it names (a permission, an I/O error)."""
    if isinstance(e, OSError) and e.errno is not None:
        return f"cannot read {e.filename or out}: {e.strerror}"
    return str(e.args[0] if isinstance(e, KeyError) and e.args else e)  # (a KeyError's str() quotes it)


@app.command(cls=_Command)
def stats(
    out: Path = typer.Argument(..., metavar="OUT", parser=_path, help="An output folder of docproc run."),
    run_id: Optional[str] = typer.Option(None, "--run", help="Show this run instead of the last one."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    limit: int = typer.Option(10, "--limit", metavar="N", help="How many recent runs to list."),
    failures: bool = typer.Option(False, "--failures", help="List every failed or partial document in OUT "
                                  "with its reason, instead of the run summary."),
) -> None:
    """Report on the runs in OUT: the last (or --run) run's summary and per-query figures, and a
    table of recent runs; or, with --failures, every document that failed and why.

    Example: docproc stats out --json; docproc stats out --failures
    """
    from docproc.pipeline.stats import collect, list_failures

    if limit < 1:
        error(f"--limit must be >= 1, got {limit}")
        raise typer.Exit(EXIT_USAGE)
    try:
        data = list_failures(out) if failures else collect(out, run_id, limit)
    except (OSError, KeyError) as e:
        error(shown(_reading_error(e, out)))
        raise typer.Exit(_reading_exit(e))
    for d in [] if failures else data["damaged_manifests"]:
        error(f"{d['file']} is {d['reason']}: run {d['run_id']} is skipped (its rows, if any, are reported "
              f"as a run without a manifest)", "warning", "yellow")
    with _report_to_stdout():
        _print_stats(data, as_json, failures)


def _reading_exit(e: Exception) -> int:
    """stats' and eval's exit code for an OUT they could not report on: 75 while a run holds it
    with nothing written yet (as for a second run), else 2."""
    from docproc.pipeline.runstore import RunInProgress

    return EXIT_LOCKED if isinstance(e, RunInProgress) else EXIT_USAGE


def _print_stats(data, as_json: bool, failures: bool) -> None:
    if as_json:
        print(json.dumps(data, indent=2), flush=True)  # (a reader gone shows here, not at exit)
        return
    if failures:
        t = Table(title=f"{len(data)} failed or partial document(s)")
        for c in ("path", "status", "kind", "reason"):
            t.add_column(c, overflow="fold")
        for f in data:
            t.add_row(escape(shown(f["path"])), f["status"], f["kind"] or "-", escape(f["error"] or "-"))
        out_console.print(t)
        return
    r = data["run"]
    for rid in data["runs_without_manifest"]:
        why = ("its manifest is damaged" if rid in {d["run_id"] for d in data["damaged_manifests"]}
               else "no manifest (the run was killed or is still running)")
        out_console.print(f"run {escape(rid)}: {why}; figures from its rows", soft_wrap=True)
    seconds = "-" if r["seconds"] is None else f"{r['seconds']:.1f}"
    out_console.print(f"[bold]run {escape(r['run_id'])}[/bold] started {escape(_fmt(r['started_at']))}, "
                      f"{seconds} s, exit {escape(_fmt(r['exit_code']))}, {escape(_fmt(r['status']))}")
    fault = data["fault"] if isinstance(data["fault"], dict) else None
    if fault is not None:  # the run stopped: what it kept (an unwritable OUT loses what it had not written)
        out_console.print(f"  fault: {escape(_fmt(fault.get('message')))}"
                          + (f"; {_fmt(fault.get('documents_kept'))} of its documents kept (the others are redone "
                             f"by the next run)" if fault.get("kind") == "output" else ""), soft_wrap=True)
    out_console.print(f"  documents {_fmt(r['documents'])} (ok {_fmt(r['ok'])}, already done "
                      f"{_fmt(r['already_done'])}), pages {_fmt(r['pages'])} (unique {_fmt(r['unique_pages'])}, "
                      f"vision encodes {_fmt(r['vision_encodes'])}), failures {_fmt(r['failures'])}, "
                      f"partial {_fmt(r['partial'])}, skipped {_fmt(r['skipped'])}")
    out_console.print(f"  generated tokens {_fmt(r['generated_tokens'])}, tokens/s {_fmt(r['tokens_per_second'])}, "
                      f"acceptance {_fmt(r['acceptance_rate'])}, cache hit rate {_fmt(r['cache_hit_rate'])}")
    stages = r["stage_seconds"] if isinstance(r["stage_seconds"], dict) else {}
    out_console.print("  stages (s): " + ("  ".join(f"{escape(str(k))} {escape(_fmt(v))}" for k, v in stages.items())
                                          or "-"))
    if data["per_query"]:
        q = Table(title="per query")
        for c in ("query", "rows", "answered", "errors", "mean tokens", "acceptance", "accepted/step",
                  "mean latency s (arrival to finish)"):
            q.add_column(c)
        for name, v in data["per_query"].items():
            q.add_row(escape(name), str(v["rows"]), str(v["answered"]), str(v["errors"]), _fmt(v["mean_generated_tokens"]),
                      _fmt(v["acceptance_rate"]), _fmt(v["mean_accepted_length"]), _fmt(v["mean_latency_s"]))
        out_console.print(q)
    if data["workers"]:
        w = Table(title="per engine worker (--ray)")
        cols = ("worker", "node", "gpus", "documents", "pages", "unique_pages", "vision_encodes", "generated_tokens",
                "tokens_per_second", "engine_seconds", "load_seconds")
        for c in cols:
            w.add_column(c.replace("_", " "))
        for row in data["workers"]:
            w.add_row(*[escape(_fmt(row[c])) for c in cols])
        out_console.print(w)
    t = Table(title="recent runs")
    cols = ("run_id", "documents", "pages", "unique_pages", "generated_tokens", "tokens_per_second",
            "acceptance_rate", "cache_hit_rate", "failures", "partial", "seconds", "status")
    for c in cols:
        t.add_column(c.replace("_", " "))
    for row in data["recent_runs"]:
        t.add_row(*[escape(_fmt(row[c])) for c in cols])
    out_console.print(t)


@app.command("eval", cls=_Command)
def eval_cmd(
    out: Path = typer.Argument(..., metavar="OUT", parser=_path, help="An output folder of docproc run."),
    truth: Path = typer.Option(..., "--truth", parser=_path, help="Ground truth, one JSON record per line (truth.jsonl)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Field exact match and F1 of OUT's answers against --truth (dates and amounts normalised).

    Example: docproc eval out --truth sample_docs/truth.jsonl --json
    """
    from docproc.pipeline.evaluate import evaluate

    try:
        res = evaluate(out, truth)
    except (OSError, json.JSONDecodeError, KeyError, ValueError) as e:
        error(shown(_reading_error(e, out)))
        raise typer.Exit(_reading_exit(e))
    if res["unreadable_state_parts"]:
        lost = res["unreadable_state_parts"]
        error(shown(f"{len(lost)} part(s) of {out}'s state cannot be read ({', '.join(lost[:3])}"
                    f"{', ...' if len(lost) > 3 else ''}): their documents are scored from results.parquet where it "
                    f"holds them"), "warning", "yellow")
    with _report_to_stdout():
        _print_eval(res, as_json)
    if res["nothing_compared"]:
        error(shown(f"nothing to score: {res['nothing_compared']}"))
        raise typer.Exit(EXIT_FAILURES)


def _print_eval(res: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(res, indent=2), flush=True)
        return
    if res["nothing_compared"]:
        return
    t = Table(title=f"{res['documents']} documents: exact match {res['overall_exact_match']:.1%}, "
                    f"F1 {res['overall_f1']:.1%}")
    for c in ("field", "exact match", "F1", "n"):
        t.add_column(c)
    for f, v in res["per_field"].items():
        t.add_row(escape(f), f"{v['exact_match']:.1%}", f"{v['f1']:.1%}", str(v["n"]))
    for g, v in res["by_format"].items():
        t.add_row(f"[dim]all fields, {g}[/dim]", f"{v['exact_match']:.1%}", "", str(v["n"]))
    out_console.print(t)
    for key, what in (("failed_documents", "failed or skipped in OUT, scored as no answer"),
                      ("missing_documents", "not in OUT, not scored"),
                      ("ambiguous_documents", "name several documents of OUT (give their paths), not scored")):
        if docs := res[key]:
            names = ", ".join(shown(m) for m in docs[:5]) + (f" and {len(docs) - 5} more (--json lists them)"
                                                             if len(docs) > 5 else "")
            out_console.print(escape(f"{len(docs)} document(s) of the truth file {what}: {names}"), soft_wrap=True)


def _stdout_gone() -> None:
    """Send what is left for stdout to /dev/null, so that the interpreter's last flush does not
    fail a run whose reader went away."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader went away (poll: an error on its write end)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # (no descriptor: a test's captured stdout)
        return False


@contextlib.contextmanager
def _report_to_stdout():
    """A report whose reader may leave early (`docproc stats OUT | head -1`): the command ends
    there with its own exit code, no traceback. A closed stderr is not this."""
    try:
        yield
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        _stdout_gone()


def entry() -> None:
    """The `docproc` command (and `python -m docproc`): main(), and a run's end leaves the process
    at once (_leave)."""
    main(leave=True)


def main(leave: bool = False) -> None:
    """The command line, for callers in-process too (leave=False: a run ends in SystemExit as any
    command does)."""
    import signal

    global _run_ended
    _run_ended = False

    from docproc.pipeline.signals import EXIT_INTERRUPTED, RunInterrupted, signals_raise

    # SIGTERM and Ctrl-C outside a run (which takes them over) end the command too, never inside
    # an import: one cut into a C extension's start-up crashed the interpreter
    guard = signals_raise()
    try:
        try:
            with guard:
                app()
        except SystemExit as e:
            if guard.raised is not None and e.code not in EXIT_INTERRUPTED.values():
                # a signal raised where the code it cut into swallowed it, the command done since
                # (a run takes such a signal over; run-batch and serve report one they caught):
                # its exit code all the same
                raise RunInterrupted(guard.raised) from None
            if leave and _run_ended:
                _leave(e.code)
            raise
    except (KeyboardInterrupt, RunInterrupted) as e:
        signum = getattr(e, "signum", signal.SIGINT)
        when = " after the run ended; its manifest is written" if guard.inner_entered else "; nothing was done"
        error(f"stopped by {signal.Signals(signum).name}{when}", "interrupted", "yellow")
        sys.exit(EXIT_INTERRUPTED[signum])


if __name__ == "__main__":
    entry()

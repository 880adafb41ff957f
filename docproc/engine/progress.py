"""A Rich progress bar over requests, drawn only when LLM.generate(use_tqdm=True): one of the
callbacks LLM.generate calls as each request finishes (on_request_done is the caller's)."""
from __future__ import annotations

import time


class Progress:
    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(TextColumn("generate"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[tps]} tok/s"), TimeElapsedColumn(), transient=True)
        self._task = self._progress.add_task("generate", total=total, tps="-")
        self._start = time.perf_counter()
        self._tokens = 0
        self._progress.start()

    def advance(self, out) -> None:
        """One request finished (its RequestOutput)."""
        self._tokens += out.metrics.num_generated_tokens
        tps = self._tokens / max(time.perf_counter() - self._start, 1e-9)
        self._progress.update(self._task, advance=1, tps=f"{tps:.1f}")

    def close(self) -> None:
        self._progress.stop()

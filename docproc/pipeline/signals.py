"""SIGTERM and SIGINT during a run: raised as RunInterrupted in the main thread, so that the run
drops the batch in flight and still ends with a manifest."""
from __future__ import annotations

import signal
import threading

EXIT_INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}


class RunInterrupted(BaseException):
    """SIGTERM or SIGINT arrived: the batch in flight is dropped, the run ends with a manifest."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class signals_raise:
    """While the run goes, SIGTERM and SIGINT raise RunInterrupted in the main thread (once:
    a second signal during the wind-down is ignored, so the manifest gets written)."""

    def __enter__(self):
        self.saved = {}
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.saved[sig] = signal.signal(sig, self._raise)
        return self

    def _raise(self, signum, frame):
        for sig in self.saved:
            signal.signal(sig, signal.SIG_IGN)
        raise RunInterrupted(signum)

    def __exit__(self, *exc):
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        return False

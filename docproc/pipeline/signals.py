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
    """While the run goes, SIGTERM and SIGINT raise RunInterrupted in the main thread, once: from
    the first signal, or from calm() (the run winding down after a fault or at its end), they are
    ignored, so that the manifest gets written; the handlers before are restored on exit."""

    def __enter__(self):
        self.saved = {}
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.saved[sig] = signal.signal(sig, self._raise)
        return self

    def _raise(self, signum, frame):
        self.calm()
        raise RunInterrupted(signum)

    def calm(self) -> None:
        """From now on the signals are ignored: the run is winding down (a manifest to write)."""
        for sig in self.saved:
            signal.signal(sig, signal.SIG_IGN)

    def __exit__(self, *exc):
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        return False

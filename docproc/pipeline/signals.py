"""SIGTERM and SIGINT during a run: raised as RunInterrupted in the main thread, so that the run
drops the batch in flight and still ends with a manifest.

Never inside an import: an exception raised while a module initialises (torch's C extension
imports its Python submodules as it starts; so do transformers' and pyarrow's) leaves the
extension half made, and the interpreter then crashes (rc -11), raises SystemError ("bad call
flags") or finds a partially initialised module. Nor while a render process starts
(pipeline/feed.py): cut while its start-up data is written, it dies with a traceback. A signal
that arrives then is kept, and raised at the first moment neither is under way, checked every
DEFER_POLL_S.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time

EXIT_INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}
DEFER_POLL_S = 0.02
_IMPORT_FRAMES = "<frozen importlib._bootstrap"  # _bootstrap and _bootstrap_external
_START_FRAMES = (os.path.join(os.path.dirname(multiprocessing.__file__), "popen_spawn_posix.py"),)


_ENTERED: list = []  # the signals_raise entered in the main thread, innermost last


def _ignored(signum, frame) -> None:
    """A signal after the first, or while a run winds down: nothing to do."""


def reraise_swallowed() -> None:
    """Raise again a RunInterrupted that code between the handler and the run swallowed: raised
    inside a Python callback of C code (torch's tensor construction from storages while a model
    loads), it comes out as that code's own error (a ValueError), and since the handler ignores
    every later signal, the run would go on as if none had come. The run's catch-all boundaries
    call this first."""
    for guard in reversed(_ENTERED):
        if guard.raised is not None:
            raise RunInterrupted(guard.raised)


class RunInterrupted(BaseException):
    """SIGTERM or SIGINT arrived: the batch in flight is dropped, the run ends with a manifest."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def importing(frame) -> bool:
    """Whether an import (or the start of a render process) is under way in the stack that ends
    in frame. Every import that is not answered from sys.modules runs importlib's bootstrap code,
    and a C extension's start-up runs between its frames, so the stack shows one of them from the
    first line to the last."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_IMPORT_FRAMES) or name in _START_FRAMES:
            return True
        frame = frame.f_back
    return False


class signals_raise:
    """While it is entered, SIGTERM and SIGINT raise RunInterrupted in the main thread, once and
    never inside an import (see the module docstring): from the first signal, or from calm() (the
    run winding down after a fault or at its end), they are ignored, so that the manifest gets
    written; the handlers before are restored on exit. Entered inside another one (docproc's main
    guards the start-up, a run takes over), a signal the outer one still holds passes to it."""

    def __init__(self) -> None:
        self.saved: dict = {}
        self.pending: int | None = None  # a signal that arrived during an import, not raised yet
        self.raised: int | None = None  # a signal raised as RunInterrupted that the run has not taken yet
        self.inner_entered = False  # a signals_raise was entered inside this one (a run started)
        self._quiet = False
        self._watcher: threading.Thread | None = None

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        swallowed = next((g for g in reversed(_ENTERED) if g.raised is not None), None)
        _ENTERED.append(self)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.saved[sig] = signal.signal(sig, self._raise)
        outer = getattr(self.saved[signal.SIGTERM], "__self__", None)
        if isinstance(outer, signals_raise):
            outer.inner_entered = True
            if outer.pending is not None:
                self.pending, outer.pending = outer.pending, None
                self._watch()
        if swallowed is not None:
            # an outer guard raised a signal that the code it cut into swallowed (pydantic's Rust
            # validators while typer parses the options keep it as an "unraisable" exception) and
            # ignores signals since: this guard holds it, to be raised at once (inside no import)
            swallowed.inner_entered = True
            if self.pending is None:
                self.pending = swallowed.raised
            swallowed.raised = None
            self._watch()
        return self

    def _raise(self, signum, frame):
        if self._quiet:
            return
        if importing(frame):
            if self.pending is None:
                self.pending = signum
            self._watch()
            return
        signum = self.pending if self.pending is not None else signum
        for guard in _ENTERED:  # the process has its signal: a guard outside this one (the command's,
            guard._quiet = True  # its handler back once the run's guard exits) takes no second one
            guard.pending = None
        self._ignore()
        self.raised = signum
        raise RunInterrupted(signum)

    def _watch(self) -> None:
        """Send the kept signal to the main thread again, every DEFER_POLL_S, while its stack shows
        no import, until the handler raises it (or the signals are calmed or handed back)."""
        if self._watcher is not None and self._watcher.is_alive():
            return
        main = threading.main_thread().ident

        def watch():
            while self.pending is not None and not self._quiet:
                time.sleep(DEFER_POLL_S)
                signum = self.pending
                if signum is None or self._quiet or signal.getsignal(signum) != self._raise:
                    return
                if not importing(sys._current_frames().get(main)):
                    signal.pthread_kill(main, signum)

        self._watcher = threading.Thread(target=watch, name="docproc-deferred-signal", daemon=True)
        self._watcher.start()

    def calm(self) -> None:
        """From now on the signals are ignored: the run is winding down (a manifest to write),
        having taken the signal raised, if one was."""
        self._ignore()
        self.raised = None

    def _ignore(self) -> None:
        """Signals do nothing from now on: a Python handler that returns, not SIG_IGN, since a
        signal the interpreter has already taken in (SIGINT and SIGTERM sent together) and finds
        ignored when it runs the handlers is reported as an error with a traceback ("Signal 15
        ignored due to race condition")."""
        self._quiet = True
        self.pending = None
        for sig in self.saved:
            signal.signal(sig, _ignored)

    def __exit__(self, *exc):
        if self in _ENTERED:
            _ENTERED.remove(self)
        self._quiet = True
        self.pending = None
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        return False

"""Faults of the environment: what stops a whole run (a document's own problems never do).

Each carries the exit code `docproc run` ends with; the message names the thing and the fix.
Torch-free, so that every layer can raise and catch them.
"""
from __future__ import annotations

EXIT_USAGE = 2  # the command or the query set asks for something that cannot be done
EXIT_MODEL = 3  # the model or the draft is missing or cannot be loaded
EXIT_DEVICE = 4  # the device asked for is not there, ran out of memory at load, or failed
EXIT_OUTPUT = 5  # the output folder cannot be written (read-only, a file, disk full)


class EnvironmentFault(Exception):
    """Something outside any one document is wrong; the run stops with `exit_code`."""

    exit_code = 1
    kind = "environment"


class ModelUnavailable(EnvironmentFault):
    exit_code = EXIT_MODEL
    kind = "model"


class DeviceUnavailable(EnvironmentFault):
    exit_code = EXIT_DEVICE
    kind = "device"


class OutputUnwritable(EnvironmentFault):
    exit_code = EXIT_OUTPUT
    kind = "output"


class QueriesUnusable(EnvironmentFault):
    """A query's constraint that the grammar backend cannot compile, found as the engine is about
    to load (compiling imports the backend, too slow for a run with nothing to do)."""

    exit_code = EXIT_USAGE
    kind = "queries"

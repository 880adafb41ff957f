"""docproc: offline structured extraction from documents with vision-language models.

Public API (vLLM-shaped): LLM, SamplingParams, StructuredOutputsParams, RequestOutput,
CompletionOutput, RequestMetrics.
They are imported on first use, so that the command line (`docproc --help`, `stats`, `eval`)
starts without loading torch.
"""
from importlib import import_module

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "RequestMetrics"]
__version__ = "0.1.0"

_WHERE = {"LLM": "docproc.engine.llm", "SamplingParams": "docproc.sampling_params",
          "StructuredOutputsParams": "docproc.sampling_params",
          "RequestOutput": "docproc.outputs", "CompletionOutput": "docproc.outputs",
          "RequestMetrics": "docproc.outputs"}


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(import_module(_WHERE[name]), name)
        globals()[name] = value  # once imported, an ordinary attribute
        return value
    raise AttributeError(f"module 'docproc' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)

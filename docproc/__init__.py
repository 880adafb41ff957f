"""docproc: offline structured extraction from documents with vision-language models.

Public API (vLLM-shaped): LLM, SamplingParams, RequestOutput.
"""
from docproc.engine.llm import LLM
from docproc.outputs import CompletionOutput, RequestMetrics, RequestOutput
from docproc.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
__version__ = "0.1.0"

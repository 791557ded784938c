"""Tandem: an LLM serving engine with load-aware speculative decoding and tool-aware scheduling.

The public names load lazily, so that `import tandem.sched` (the simulator's path) never pulls in
torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "tandem.llm",
    "SamplingParams": "tandem.sampling_params",
    "RequestOutput": "tandem.outputs",
    "CompletionOutput": "tandem.outputs",
    "TandemError": "tandem.errors",
    "InvalidRequestError": "tandem.errors",
    "ModelLoadError": "tandem.errors",
    "ConfigError": "tandem.errors",
    "StructuredOutputs": "tandem.structured.spec",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__ + ["__version__"])

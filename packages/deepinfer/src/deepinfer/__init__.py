"""DeepInfer: offline inference for DeepSeek-V4.1-class MoE models.

from deepinfer import LLM, SamplingParams
llm = LLM()  # the built-in random-weight deepinfer-tiny, or LLM(model="/path/to/checkpoint")
out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0.8, seq_seed=1))

Streaming, in an event loop: `async for out in AsyncLLM(...).generate(prompt, params)` (async_llm.py);
`deepinfer serve` puts it behind an OpenAI-compatible HTTP server (deepinfer.serve).

The names below are imported from their modules on first use, so that the `deepinfer` command's help,
version and usage errors do not pay for torch and the model package.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# module (as an import statement spells it, relative to this package) -> the public names it defines
_MODULES: dict[str, tuple[str, ...]] = {
    ".async_llm": ("AsyncLLM", "EngineDeadError", "QueueFullError"),
    ".engine.llm_engine": ("LLMEngine",),
    ".engine_args": ("EngineArgs",),
    ".llm": ("LLM",),
    ".outputs": ("CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput"),
    ".sampling_params": ("SamplingParams",),
    ".streaming": ("RequestStream",),
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
    loaded = importlib.import_module(module, __name__)
    for public in _MODULES[module]:
        globals()[public] = getattr(loaded, public)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

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

from deepinfer_cluster import lazy_exports

__version__ = "0.1.0"

# module (as an import statement spells it, relative to this package) -> the public names it defines
_MODULES: dict[str, tuple[str, ...]] = {
    ".async_llm": ("AsyncLLM", "EngineDeadError", "QueueFullError"),
    ".engine.llm_engine": ("LLMEngine",),
    ".engine_args": ("EngineArgs",),
    ".llm": ("LLM",),
    ".outputs": ("CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput"),
    ".reasoning": ("ReasoningSplit", "ReasoningStream", "split_reasoning"),
    ".sampling_params": ("SamplingParams",),
    ".streaming": ("RequestStream",),
    ".tool_calls": ("ToolCall", "ToolCallSplit", "ToolCallStream", "parse_tool_calls"),
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, globals(), _MODULES)

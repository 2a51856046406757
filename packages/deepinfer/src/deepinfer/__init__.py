"""DeepInfer: offline inference for DeepSeek-V4.1-class MoE models.

from deepinfer import LLM, SamplingParams
llm = LLM()  # the built-in random-weight deepinfer-tiny, or LLM(model="/path/to/checkpoint")
out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0.8, seq_seed=1))

Streaming, in an event loop: `async for out in AsyncLLM(...).generate(prompt, params)` (async_llm.py);
`deepinfer serve` puts it behind an OpenAI-compatible HTTP server (deepinfer.serve).
"""

from .async_llm import AsyncLLM, EngineDeadError, QueueFullError
from .engine.llm_engine import LLMEngine
from .engine_args import EngineArgs
from .llm import LLM
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .streaming import RequestStream

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineDeadError",
    "QueueFullError",
    "RequestStream",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]

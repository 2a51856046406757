"""DeepInfer: offline inference for DeepSeek-V4.1-class MoE models.

from deepinfer import LLM, SamplingParams
llm = LLM()  # the built-in random-weight deepinfer-tiny, or LLM(model="/path/to/checkpoint")
out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0.8, seq_seed=1))
"""

from .engine.llm_engine import LLMEngine
from .engine_args import EngineArgs
from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]

"""deepinfer-eval: AIME / HLE / GPQA Diamond — convert, generate, score, report.

Importing this package loads neither torch nor the engine; math-verify, datasets and numpy are
imported only by the functions that need them.
"""

from deepinfer_eval.convert import BENCHMARKS, convert_file, convert_rows, load_rows, read_tasks
from deepinfer_eval.extract import (
    aime_score,
    final_part,
    gpqa_extract,
    gpqa_score,
    hle_confidence,
    hle_extract,
)
from deepinfer_eval.generate import (
    Completion,
    EngineGenerator,
    Generator,
    SamplingConfig,
    plan_jobs,
    run_generation,
)
from deepinfer_eval.images import image_data_url
from deepinfer_eval.judges import (
    ExactMatchJudge,
    GeneratorBackend,
    HttpChatBackend,
    Judge,
    JudgeCache,
    JudgeItem,
    LLMJudge,
    Verdict,
)
from deepinfer_eval.records import Problem, read_jsonl, write_jsonl
from deepinfer_eval.report import build_report, print_report
from deepinfer_eval.score import score_records
from deepinfer_eval.stats import (
    bootstrap_interval,
    calibration_error,
    clustered_interval,
    pass_at_1,
    task_rates,
)

__version__ = "0.1.0"

__all__ = [
    "BENCHMARKS",
    "Completion",
    "EngineGenerator",
    "ExactMatchJudge",
    "Generator",
    "GeneratorBackend",
    "HttpChatBackend",
    "Judge",
    "JudgeCache",
    "JudgeItem",
    "LLMJudge",
    "Problem",
    "SamplingConfig",
    "Verdict",
    "aime_score",
    "bootstrap_interval",
    "build_report",
    "calibration_error",
    "clustered_interval",
    "convert_file",
    "convert_rows",
    "final_part",
    "gpqa_extract",
    "gpqa_score",
    "hle_confidence",
    "hle_extract",
    "image_data_url",
    "load_rows",
    "pass_at_1",
    "plan_jobs",
    "print_report",
    "read_jsonl",
    "read_tasks",
    "run_generation",
    "score_records",
    "task_rates",
    "write_jsonl",
]

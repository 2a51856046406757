"""Reproducibility tooling: decode-perplexity workloads, the per-platform baseline file and its lock.

```python
from deepinfer import LLM
from deepinfer.reproducibility import BaselineFile, current_platform, run_workload, workloads_for

llm = LLM()
platform = current_platform(llm)  # where its model runs: "cpu", "nvidia-sm90", ...
store = BaselineFile("tests/models/offline_decode_ppl.json")
for w in workloads_for(platform, llm.engine.max_model_len):
    store.update(platform, {w.name: run_workload(llm, w)})  # merge under the cross-process lock
```
"""

from .baseline import LOCK_KINDS, BaselineFile
from .platform import current_platform, tolerance
from .ppl import compare, decode_ppl, model_tag, run_workload, tokens_digest
from .workloads import CPU_WORKLOADS, GPU_WORKLOADS, PplWorkload, workload, workloads_for

__all__ = [
    "CPU_WORKLOADS",
    "GPU_WORKLOADS",
    "LOCK_KINDS",
    "BaselineFile",
    "PplWorkload",
    "compare",
    "current_platform",
    "decode_ppl",
    "model_tag",
    "run_workload",
    "tokens_digest",
    "tolerance",
    "workload",
    "workloads_for",
]

"""Reproducibility tooling: decode-perplexity workloads, the per-platform baseline file and its lock.

```python
from deepinfer import LLM
from deepinfer.reproducibility import BaselineFile, current_platform, nextn_decode, run_workload, workloads_for

store = BaselineFile("tests/models/offline_decode_ppl.json")
for w in workloads_for("cpu"):  # on a GPU: workloads_for(platform, the checkpoint's context)
    with nextn_decode(w.nextn):  # the engine fixes its draft count when built
        llm = LLM(device="cpu")  # longer workloads: max_model_len=input_len + output_len
    platform = current_platform(llm)  # where its model runs: "cpu", "nvidia-sm90", ...
    store.update(platform, {w.name: run_workload(llm, w)})  # merge under the cross-process lock
    llm.close()
```
"""

from .baseline import LOCK_KINDS, BaselineFile
from .platform import current_platform, tolerance
from .ppl import compare, decode_ppl, model_tag, nextn_decode, run_workload, tokens_digest
from .workloads import CPU_WORKLOADS, GPU_WORKLOADS, SCALED_SUFFIX, PplWorkload, workload, workloads_for

__all__ = [
    "CPU_WORKLOADS",
    "GPU_WORKLOADS",
    "LOCK_KINDS",
    "SCALED_SUFFIX",
    "BaselineFile",
    "PplWorkload",
    "compare",
    "current_platform",
    "decode_ppl",
    "model_tag",
    "nextn_decode",
    "run_workload",
    "tokens_digest",
    "tolerance",
    "workload",
    "workloads_for",
]

"""Environment reads per drafted step: the model's settings (`DEEPINFER_NUMERICS`, `DEEPINFER_BATCH_INVARIANT`,
`DEEPINFER_ACCELERATOR`) are read once per model forward (`numerics.resolved`), not at every layer and op.

Every read goes through `deepinfer_cluster.envs.get` (tests/test_env_registry.py keeps it so), which the
test wraps to count the reads of one drafted step of the random-weight tiny V4.1: hundreds per step on the
paged runner and tens of thousands on the recompute runner when every layer read them, a few per forward
now. Outputs stay those of the same engine without the count (the values read are the same).
"""

import pytest
from deepinfer import SamplingParams
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer_cluster import envs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint

PROMPTS = [[0, 17, 99, 4, 250, 61, 8, 130], [5, 6, 7, 8], [100, 3, 42], [9, 9, 1]]
NEXTN = 3


@pytest.fixture(scope="module")
def v41(tmp_path_factory, share_loaded_models):
    return make_v41_checkpoint(tmp_path_factory.mktemp("v41-env-reads"), seed=0)


class CountedReads:
    """While entered, every `envs.get` call is counted (and answered by the real one)."""

    def __init__(self) -> None:
        self.count = 0
        self.real = envs.get

    def get(self, name, environ=None):
        self.count += 1
        return self.real(name, environ)

    def __enter__(self):
        envs.get = self.get
        return self

    def __exit__(self, *exc) -> None:
        envs.get = self.real


def run(path, runner: str, reads: list | None):
    """Tokens per prompt; with `reads`, the envs.get calls of each step in which drafts were verified."""
    engine = LLMEngine(
        EngineArgs(model=str(path), block_size=16, max_model_len=48, runner=runner),
        num_speculative_tokens=NEXTN,
    )
    for j, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=0.8 * (j % 2), max_tokens=8, ignore_eos=True, seq_seed=j)
        engine.add_request(str(j), None, params, prompt_token_ids=prompt)
    outs = {}
    while engine.has_unfinished_requests():
        verified = engine.spec.stats.summary()["verified"]
        if reads is None:
            outs.update({o.request_id: o for o in engine.step()})
            continue
        with CountedReads() as counted:
            outs.update({o.request_id: o for o in engine.step()})
        if engine.spec.stats.summary()["verified"] > verified:
            reads.append(counted.count)
    engine.close()
    return [list(outs[str(j)].outputs[0].token_ids) for j in range(len(PROMPTS))]


@pytest.mark.parametrize(
    ("runner", "per_step"),
    [
        # one target forward and a draft forward per draft length (greedy and sampled rows draft apart):
        # three settings each, plus the drafter's confidence temperatures
        ("paged", 16),
        # one target forward and one draft forward per sequence
        ("recompute", 4 * (1 + len(PROMPTS)) + 2 * len(PROMPTS)),
    ],
)
def test_a_drafted_step_reads_the_settings_once_per_forward(v41, runner, per_step):
    reads = []
    tokens = run(v41, runner, reads)
    assert reads, "no step verified drafts"
    assert max(reads) <= per_step, reads
    assert tokens == run(v41, runner, None)

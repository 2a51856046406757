"""cache_salt: requests share prefix-cache blocks only within one salt (YoCo truncation salts by
prompt length, because its KV depends on more than the tokens)."""

import numpy as np
import pytest
from deepinfer_sched import Scheduler, SchedulerConfig


def _run_one(sched: Scheduler, prompt, salt):
    seq = sched.add_request(prompt, max_tokens=1, cache_salt=salt)
    out = sched.schedule()
    assert list(out.seq_ids) == [seq]
    start = int(out.start_positions[0])
    sched.update_from_output(out, np.array([7], dtype=np.int32))
    return start


@pytest.mark.parametrize("hash_bits", [64, 0])  # 0 bits: every lookup collides, confirmation decides
def test_hits_only_within_one_salt(hash_bits):
    sched = Scheduler(
        SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64, prefix_hash_bits=hash_bits)
    )
    prompt = list(range(1, 14))  # three full blocks are cacheable
    assert _run_one(sched, prompt, salt=5) == 0
    assert _run_one(sched, prompt, salt=6) == 0  # another namespace: no hit
    assert _run_one(sched, prompt, salt=0) == 0  # the shared namespace is a namespace too
    assert _run_one(sched, prompt, salt=5) == 12  # same salt: the three blocks hit
    assert _run_one(sched, prompt, salt=0) == 12
    sched.check_invariants()


def test_bad_salt_is_refused_and_leaves_no_trace():
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=32))
    for bad in (-1, 2**63, 1.5, True):
        with pytest.raises(ValueError, match=r"cache_salt must be an integer in \[0, 2\*\*63\)"):
            sched.add_request([1, 2, 3], cache_salt=bad)
    assert sched.num_unfinished == 0

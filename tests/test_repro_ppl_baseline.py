"""Decode-perplexity baselines: `tests/models/offline_decode_ppl.json`, keyed by platform and workload,
compared sample by sample with the platform's tolerance; `--refresh-ppl-baseline` rewrites this
platform's entries under the file lock. The lock is tested with concurrent writer processes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deepinfer.reproducibility import (
    BaselineFile,
    compare,
    current_platform,
    decode_ppl,
    run_workload,
    tolerance,
    workloads_for,
)
from deepinfer.reproducibility import baseline as baseline_module

BASELINE = Path(__file__).parent / "models" / "offline_decode_ppl.json"
PLATFORM = current_platform()


# ------------------------------------------------------------------------------------ the file lock
# Each writer is a separate interpreter (as on separate nodes): it shares nothing but the file system.
_WRITER = """
import importlib.util, sys
# load baseline.py alone: the writers then start in a fraction of a second (no torch import)
spec = importlib.util.spec_from_file_location("baseline", sys.argv[5])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
BaselineFile = mod.BaselineFile
path, lock, writer, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = BaselineFile(path, lock=lock)
for k in range(count):
    # writers share platforms (so they race on the same dict) but own distinct workload names
    store.update(f"platform-{writer % 2}", {f"w{writer}-{k}": {"ppl": [float(writer), float(k)]}})
"""


@pytest.mark.parametrize("lock", ["flock", "soft"])
def test_concurrent_writers_never_lose_entries(tmp_path, lock):
    path = tmp_path / "baseline.json"
    BaselineFile(path, lock=lock).update("other", {"kept": {"ppl": [1.0]}})  # an entry no writer touches
    writers, count = 6, 15
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(path), lock, str(w), str(count), baseline_module.__file__]
        )
        for w in range(writers)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0] * writers
    data = json.loads(path.read_text())
    assert data["other"] == {"kept": {"ppl": [1.0]}}
    for w in range(writers):
        for k in range(count):
            assert data[f"platform-{w % 2}"][f"w{w}-{k}"] == {"ppl": [float(w), float(k)]}
    assert sum(len(v) for v in data.values()) == writers * count + 1
    assert not list(tmp_path.glob("*.tmp"))  # no temporary file left behind


def test_update_replaces_only_the_given_entries(tmp_path):
    store = BaselineFile(tmp_path / "b.json")
    store.update("cpu", {"a": {"ppl": [1.0]}, "b": {"ppl": [2.0]}})
    store.update("nvidia-sm90", {"a": {"ppl": [3.0]}})
    store.update("cpu", {"a": {"ppl": [4.0]}})
    assert store.read() == {
        "cpu": {"a": {"ppl": [4.0]}, "b": {"ppl": [2.0]}},
        "nvidia-sm90": {"a": {"ppl": [3.0]}},
    }
    with pytest.raises(ValueError, match="lock must be one of"):
        BaselineFile(tmp_path / "b.json", lock="nfs")
    with pytest.raises(ValueError, match="platform"):
        store.update("", {})


# ---------------------------------------------------------------------------------- the PPL metric
def test_decode_ppl_is_the_model_perplexity_of_its_greedy_continuation(llm_factory):
    """The engine's per-token logprobs, turned into decode PPL, equal a float64 recomputation from the
    stateless model forward over prompt + generated tokens (teacher-forced, independent of the engine)."""
    w = workloads_for(PLATFORM)[0]
    llm = llm_factory(async_scheduling=False)
    record = run_workload(llm, w)
    prompt = w.prompts(llm.engine.vocab_size)[0]
    out = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params={"temperature": 0.0, "max_tokens": w.output_len, "ignore_eos": True, "logprobs": 0},
        use_tqdm=False,
    )[0].outputs[0]
    seq = torch.tensor(prompt + out.token_ids)
    logits = llm.engine.model.forward(seq[:-1]).logits[len(prompt) - 1 :].double()
    lp = torch.log_softmax(logits, dim=-1).gather(1, seq[len(prompt) :, None])[:, 0]
    assert out.token_ids == torch.argmax(logits, dim=-1).tolist()  # greedy
    ref = math.exp(-float(lp.mean()))
    assert math.isclose(record["ppl"][0], ref, rel_tol=1e-6)
    assert math.isclose(decode_ppl([-1.0, -3.0]), math.exp(2.0))
    with pytest.raises(ValueError):
        decode_ppl([])
    llm.close()


def test_compare_flags_each_sample_outside_the_tolerance():
    base = {"num_prompts": 2, "input_len": 4, "output_len": 2, "nextn": 0, "ppl": [10.0, 20.0]}
    assert compare(base, dict(base, ppl=[10.0 + 1e-5, 20.0]), rtol=1e-3) == []
    problems = compare(base, dict(base, ppl=[10.0, 20.1]), rtol=1e-3)
    assert len(problems) == 1 and problems[0].startswith("sample 1")
    assert any("refresh" in p for p in compare(base, dict(base, output_len=3), rtol=1e-3))


# --------------------------------------------------------------------------- against the baseline
def _workload_params():
    out = []
    for w in workloads_for(PLATFORM):
        marks = [pytest.mark.long_context] if w.long_context else []
        out.append(pytest.param(w, id=w.name, marks=marks))
    return out


@pytest.mark.parametrize("workload", _workload_params())
def test_decode_ppl_matches_the_platform_baseline(workload, llm_factory, request, deterministic_env):
    llm = llm_factory(async_scheduling=True)
    measured = run_workload(llm, workload)
    llm.close()
    store = BaselineFile(BASELINE)
    if request.config.getoption("--refresh-ppl-baseline"):
        store.update(PLATFORM, {workload.name: measured})
        return
    baseline = store.entry(PLATFORM, workload.name)
    if baseline is None:
        pytest.skip(f"no {PLATFORM}/{workload.name} baseline yet: run pytest with --refresh-ppl-baseline")
    problems = compare(baseline, measured, tolerance(PLATFORM))
    assert not problems, "\n".join(problems)

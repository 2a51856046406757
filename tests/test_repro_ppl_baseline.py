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
from deepinfer.default_model import resolve_model
from deepinfer.reproducibility import (
    CPU_WORKLOADS,
    GPU_WORKLOADS,
    BaselineFile,
    compare,
    current_platform,
    decode_ppl,
    model_tag,
    run_workload,
    tolerance,
    workloads_for,
)
from deepinfer.reproducibility import baseline as baseline_module

BASELINE = Path(__file__).parent / "models" / "offline_decode_ppl.json"
HAS_CUDA = torch.cuda.is_available()


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
    w = workloads_for("cpu")[0]
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
    tagged = dict(base, model="A(h=1)")
    assert compare(tagged, dict(tagged), rtol=1e-3) == []
    assert any(p.startswith("model:") for p in compare(tagged, dict(tagged, model="B(h=2)"), rtol=1e-3))


# ------------------------------------------------------------------------------------ the platform
def test_platform_key_follows_the_device():
    assert current_platform("cpu") == "cpu" and current_platform(torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match="device"):
        current_platform("tpu")
    assert tolerance("cpu") == 1e-3 and tolerance("nvidia-sm90") == 5e-3 and tolerance("nvidia-sm100") == 2e-2
    if HAS_CUDA:
        major, minor = torch.cuda.get_device_capability()
        assert current_platform("cuda") == f"nvidia-sm{major}{minor}"


def test_gpu_workloads_scale_to_a_short_model_context():
    assert workloads_for("cpu") == CPU_WORKLOADS
    assert workloads_for("nvidia-sm90") == GPU_WORKLOADS == workloads_for("nvidia-sm90", 65_536)
    tiny = workloads_for("nvidia-sm90", 256)
    assert [w.name for w in tiny] == [w.name for w in GPU_WORKLOADS] and tiny == CPU_WORKLOADS
    mixed = workloads_for("nvidia-sm90", 2048)  # short fits, long_context does not
    assert mixed == (GPU_WORKLOADS[0], CPU_WORKLOADS[1])
    with pytest.raises(ValueError, match="max_model_len must be >= 1"):
        workloads_for("nvidia-sm90", 0)


# --------------------------------------------------------------------------- against the baseline
def _model_max_len() -> int:
    """Context of the checkpoint the engine loads by default ($DEEPINFER_HF_MODEL_DIR, else tiny)."""
    raw = json.loads((resolve_model(None)[0] / "config.json").read_text())
    return int(raw.get("text_config", raw).get("max_position_embeddings", 4096))


def _workload_params():
    """(device, platform, workload): the CPU's workloads on the CPU; on a GPU machine also the GPU's,
    with the model on CUDA (`gpu` marker), at full size when the checkpoint's context allows."""
    out = []
    gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
    runs = [("cpu", "cpu", workloads_for("cpu"))]
    if HAS_CUDA:
        platform = current_platform("cuda")
        runs.append(("cuda", platform, workloads_for(platform, _model_max_len())))
    else:  # listed (and skipped) so the GPU variant shows up in every report
        runs.append(("cuda", "nvidia", GPU_WORKLOADS))
    for device, platform, workloads in runs:
        for w in workloads:
            marks = ([pytest.mark.long_context] if w.long_context else []) + (gpu if device == "cuda" else [])
            out.append(pytest.param(device, platform, w, id=f"{device}-{w.name}", marks=marks))
    return out


@pytest.mark.parametrize(("device", "platform", "workload"), _workload_params())
def test_decode_ppl_matches_the_platform_baseline(
    device, platform, workload, llm_factory, request, deterministic_env
):
    need = workload.input_len + workload.output_len
    extra = {"max_model_len": need} if need > 4096 else {}  # the engine's default context is 4096
    llm = llm_factory(async_scheduling=True, device=device, max_num_seqs=workload.num_prompts, **extra)
    assert current_platform(llm) == platform  # the key follows where the model really runs
    measured = run_workload(llm, workload)
    assert measured["model"] == model_tag(llm)
    llm.close()
    store = BaselineFile(BASELINE)
    if request.config.getoption("--refresh-ppl-baseline"):
        store.update(platform, {workload.name: measured})
        return
    baseline = store.entry(platform, workload.name)
    if baseline is None:
        pytest.skip(f"no {platform}/{workload.name} baseline yet: run pytest with --refresh-ppl-baseline")
    problems = compare(baseline, measured, tolerance(platform))
    assert not problems, "\n".join(problems)

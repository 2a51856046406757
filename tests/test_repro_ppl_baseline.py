"""Decode-perplexity baselines: `tests/models/offline_decode_ppl.json`, keyed by platform and workload,
compared sample by sample with the platform's tolerance; `--refresh-ppl-baseline` rewrites this
platform's entries under the file lock. The lock is tested with concurrent writer processes."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deepinfer.default_model import resolve_model
from deepinfer.reproducibility import (
    CPU_WORKLOADS,
    GPU_WORKLOADS,
    SCALED_SUFFIX,
    BaselineFile,
    PplWorkload,
    compare,
    current_platform,
    decode_ppl,
    model_tag,
    nextn_decode,
    run_workload,
    tolerance,
    workloads_for,
)
from deepinfer.reproducibility import baseline as baseline_module

BASELINE = Path(__file__).parent / "models" / "offline_decode_ppl.json"
LONG_TINY_SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gpu" / "make_long_tiny_checkpoint.py"
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
    """A GPU workload too long for the model runs at the CPU's size under its own name, so scaled and
    full-size baselines of one platform never share an entry; the CPU keeps the plain names."""
    assert workloads_for("cpu") == CPU_WORKLOADS
    assert [w.name for w in CPU_WORKLOADS] == ["short", "long_context"]
    assert workloads_for("nvidia-sm90") == GPU_WORKLOADS == workloads_for("nvidia-sm90", 65_536)
    tiny = workloads_for("nvidia-sm90", 256)
    assert [w.name for w in tiny] == ["short.cpu_size", "long_context.cpu_size"]
    for scaled, cpu in zip(tiny, CPU_WORKLOADS, strict=True):  # the CPU's shape and prompts, renamed
        assert scaled.name == cpu.name + SCALED_SUFFIX
        assert scaled.describe() | {"name": cpu.name} == cpu.describe()
        assert scaled.prompts(129_280) == cpu.prompts(129_280)
    mixed = workloads_for("nvidia-sm90", 2048)  # short fits, long_context does not
    assert mixed[0] == GPU_WORKLOADS[0] and mixed[1] == tiny[1]
    names = {w.name for w in GPU_WORKLOADS}
    assert not names & {w.name for w in tiny}  # a full-size entry is never the scaled run's baseline
    with pytest.raises(ValueError, match="max_model_len must be >= 1"):
        workloads_for("nvidia-sm90", 0)


def test_baseline_file_keeps_scaled_and_full_size_gpu_entries_apart():
    """The checked-in file: CPU entries under the plain names; the tiny model's GPU entries under the
    scaled names with the CPU's shapes; any full-size GPU entry has the full-size shape."""
    data = json.loads(BASELINE.read_text())
    full = {w.name: w for w in GPU_WORKLOADS}
    assert set(data["cpu"]) == {w.name for w in CPU_WORKLOADS}
    for platform, entries in data.items():
        if platform == "cpu":
            continue
        for name, record in entries.items():
            if name.endswith(SCALED_SUFFIX):
                expected = next(w for w in workloads_for(platform, 256) if w.name == name)
            else:
                expected = full[name]
            for key in ("num_prompts", "input_len", "output_len", "nextn"):
                assert record[key] == getattr(expected, key), (platform, name, key)
    assert {f"short{SCALED_SUFFIX}", f"long_context{SCALED_SUFFIX}"} <= set(data["nvidia-sm90"])


def _load_long_tiny_script():
    spec = importlib.util.spec_from_file_location("make_long_tiny_checkpoint", LONG_TINY_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_long_context_checkpoint_gets_the_full_size_workloads(tmp_path, monkeypatch):
    """benchmarks/gpu/make_long_tiny_checkpoint.py's config (config.json only: the weights are the tiny
    model's) parses, keeps YaRN consistent, and the GPU test then picks the full-size workloads."""
    from deepinfer_model.models.deepseek_v41.config import DeepseekV41Config

    config = _load_long_tiny_script().long_tiny_config(32_768)
    text = config["text_config"]
    rope = text["rope_scaling"]
    assert (
        rope["original_max_position_embeddings"] * rope["factor"] == text["max_position_embeddings"] == 32_768
    )
    DeepseekV41Config.from_dict(config)  # a valid V4.1 config
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path))
    assert _model_max_len() == 32_768
    assert workloads_for("nvidia-sm90", _model_max_len()) == GPU_WORKLOADS
    longest = max(w.input_len + w.output_len + w.nextn for w in GPU_WORKLOADS)
    assert longest <= 32_768  # room for the drafts of the last verify step too
    with pytest.raises(ValueError, match="max_position_embeddings must be a multiple"):
        _load_long_tiny_script().long_tiny_config(1000)


def test_the_engine_drafts_as_many_tokens_as_the_workload_says(llm_factory):
    """The engine fixes its draft count when it is built: nextn_decode must wrap the LLM's construction,
    and run_workload refuses an engine whose draft count differs from the workload's (its record would
    name a nextn that did not run)."""
    before = os.environ.get("DEEPINFER_USE_NEXTN_DECODE")
    with nextn_decode(0):
        assert os.environ["DEEPINFER_USE_NEXTN_DECODE"] == "0"  # set, not left unset (real checkpoints: 5)
        with nextn_decode(3):
            assert os.environ["DEEPINFER_USE_NEXTN_DECODE"] == "3"
            llm = llm_factory()
        assert os.environ["DEEPINFER_USE_NEXTN_DECODE"] == "0"
    assert os.environ.get("DEEPINFER_USE_NEXTN_DECODE") == before
    assert llm.engine.num_speculative_tokens == 3
    with pytest.raises(ValueError, match="nextn is 0 but the engine drafts 3"):
        run_workload(llm, PplWorkload("x", num_prompts=1, input_len=4, output_len=2))
    llm.close()
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        with nextn_decode(-1):
            pass


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
    with nextn_decode(workload.nextn):  # the engine fixes its draft count when built
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

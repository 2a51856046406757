"""benchmarks/spec/bench_spec_engine.py at minimal size on the CPU: the recorded (oracle) drafter is right
on every draft and cuts the steps, every configuration emits the drafts-off tokens, and the records carry
the keys the GPU report reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "spec"))
import bench_spec_engine as bench  # noqa: E402

KEYS = {"config", "nextn", "batch", "prompts", "device", "steps", "generated_tokens", "accept_rate",
        "avg_accepted_len", "tokens_per_request_step", "wall_s", "draft_s", "tok_per_s", "tok_per_s_per_user",
        "same_tokens_as_none", "speedup_steps", "speedup_tok_per_s"}  # fmt: skip


def test_oracle_and_model_drafts_against_drafts_off(tmp_path):
    out = tmp_path / "spec.json"
    assert (
        bench.main(
            ["--nextn", "3", "--batch", "2", "--max-tokens", "14", "--repeats", "1", "--out", str(out)]
        )
        == 0
    )
    records = {r["config"]: r for r in json.loads(out.read_text())}
    assert set(records) == {"none", "oracle", "model"}
    for r in records.values():
        assert KEYS <= set(r) and r["same_tokens_as_none"] and r["generated_tokens"] == 2 * 14
    assert records["oracle"]["accept_rate"] == 1.0
    # 13 decode tokens per request after the prefill's: at most 4 per step with every draft right (the
    # policy's first plain measuring steps included), 13 without
    assert records["none"]["steps"] == 14 and records["oracle"]["steps"] <= 9


def test_bad_arguments_name_the_flag(tmp_path):
    with pytest.raises(SystemExit, match="--configs must start with none"):
        bench.main(["--configs", "oracle", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="--batch must be >= 1"):
        bench.main(["--batch", "0", "--out", str(tmp_path / "x.json")])


def test_code_prompts_are_the_starts_of_this_repositorys_sources():
    """--prompts code: --batch prompts of --prompt-len ids, each the start of a Python source file here,
    in the model's vocabulary (the built-in checkpoint's tokenizer)."""
    from types import SimpleNamespace

    from deepinfer.default_model import resolve_model
    from deepinfer.tokenizer import load_tokenizer

    path, _ = resolve_model(None)
    tokenizer = load_tokenizer(path)
    engine = SimpleNamespace(tokenizer=tokenizer, vocab_size=tokenizer.get_vocab_size())
    args = SimpleNamespace(prompts="code", batch=3, prompt_len=40, model=path)
    prompts = bench.make_prompts(engine, args)
    assert len(prompts) == 3 and all(len(p) == 40 for p in prompts) and len({tuple(p) for p in prompts}) == 3
    sources = [f.read_text() for f in sorted(bench.ROOT.glob("packages/*/src/**/*.py"))]
    for p in prompts:
        text = tokenizer.decode(p)
        assert any(s.startswith(text) for s in sources), text

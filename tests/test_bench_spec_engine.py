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

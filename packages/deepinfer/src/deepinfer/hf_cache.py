"""`--model org/name` resolved offline through the local Hugging Face cache (nothing is downloaded).

The cache layout huggingface_hub documents: the hub cache directory is `$HF_HUB_CACHE`, else
`$HF_HOME/hub`, else `~/.cache/huggingface/hub`; a model repository `org/name` lives in
`models--org--name/`, whose `refs/<revision>` file holds the commit hash of that revision and
`snapshots/<commit>/` the checkpoint's files as they were at that commit.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(model: str) -> bool:
    """`org/name` or `org/name@revision` (not a path: no leading `/`, `.` or `~`, one slash)."""
    return bool(_REPO_ID.match(model.split("@", 1)[0]))


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def cached_snapshot(model: str, cache_dir: Path | None = None) -> Path:
    """The snapshot directory of `org/name[@revision]` (revision: a branch or tag name, or a commit
    hash; default `main`); ValueError naming what was looked for when it is not in the cache."""
    repo_id, _, revision = model.partition("@")
    revision = revision or "main"
    cache = cache_dir or hub_cache_dir()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    hint = (
        f"download it first (e.g. `huggingface-cli download {repo_id}`) or pass a checkpoint directory; "
        "this engine never downloads"
    )
    if not repo.is_dir():
        raise ValueError(
            f"model {model!r} is not a local directory and not in the Hugging Face cache "
            f"(no {repo}; the cache is $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub): {hint}"
        )
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        have = sorted(p.name for p in (repo / "refs").glob("*")) if (repo / "refs").is_dir() else []
        raise ValueError(
            f"model {model!r}: revision {revision!r} is not in the Hugging Face cache at {repo} "
            f"(cached refs: {have or 'none'}): {hint}"
        )
    if not (snapshot / "config.json").is_file():
        raise ValueError(
            f"model {model!r}: the cached snapshot {snapshot} has no config.json (an incomplete download?): {hint}"
        )
    return snapshot

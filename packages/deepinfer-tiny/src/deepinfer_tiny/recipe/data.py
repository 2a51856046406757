"""Offline, reproducible training data: what the training machine's image already holds, plus arithmetic.

Sources (found at run time, so the same code builds the same kind of corpus on any machine):
* `stdlib`: the running Python's standard library `.py` files (`sysconfig` "stdlib");
* `site`: `.py` files of the installed packages (`sysconfig` purelib / platlib and `site`);
* `docs`: documentation text: `/usr/share/doc` (plain and gzipped), and `.md` / `.rst` / `.txt` files and
  `METADATA` in the package directories;
* `arithmetic`: seeded synthetic problems in the eval harness's format (`recipe.arithmetic`).

Each file belongs to a group (its top-level package, stdlib module or doc directory); a group goes to
the held-out split by a hash of its name, so held-out files are whole packages never trained on. The
manifest lists every file used (path, size, sha256, split), the arithmetic generator and seed, and the
token counts. Documents are tokenised with the real DeepSeek-V4 tokenizer, each wrapped in BOS ... EOS.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import arithmetic

BOS_ID, EOS_ID = 0, 1
MAX_FILE_BYTES = 256 * 1024  # larger files are mostly generated tables or data


@dataclass(frozen=True)
class Source:
    name: str
    roots: tuple[Path, ...]
    suffixes: tuple[str, ...]
    max_bytes: int  # cap on the source's total text (files taken in a fixed hashed order)


@dataclass(frozen=True)
class DataSpec:
    sources: tuple[Source, ...]
    heldout_fraction: float = 0.05
    arithmetic_train: int = 40000
    arithmetic_heldout: int = 500
    seed: int = 0


def machine_sources(scale: float = 1.0) -> tuple[Source, ...]:
    """The sources of the running interpreter's machine; `scale` multiplies every byte cap."""
    paths = sysconfig.get_paths()
    stdlib = Path(paths["stdlib"])
    sites = {
        Path(p) for p in (paths["purelib"], paths["platlib"], *site.getsitepackages()) if Path(p).is_dir()
    }
    sites = tuple(sorted(p for p in sites if p != stdlib))
    docs = (Path("/usr/share/doc"), *sites)
    mb = int(2**20 * scale)
    return (
        Source("stdlib", (stdlib,), (".py",), 40 * mb),
        Source("site", sites, (".py",), 60 * mb),
        Source("docs", docs, (".md", ".rst", ".txt", "METADATA", "README", "copyright", ".gz"), 12 * mb),
    )


def default_spec(scale: float = 1.0) -> DataSpec:
    return DataSpec(machine_sources(scale))


def _hash01(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") / 2**64


def _group(source: Source, root: Path, path: Path) -> str:
    rel = path.relative_to(root).parts
    top = rel[0]
    if source.name == "stdlib" and top == "site-packages":
        return ""
    if top.endswith((".dist-info", ".egg-info")):
        top = top.split("-")[0].lower()
    return top.removesuffix(".py")


def _files(source: Source) -> list[tuple[str, Path, str]]:
    """(group, path, key) of every candidate file, in a fixed order independent of the file system's."""
    out = []
    for root in source.roots:
        if not root.is_dir():
            continue
        for path in root.rglob("*"):
            if not path.is_file() or path.is_symlink() or not path.name.endswith(source.suffixes):
                continue
            if source.name == "docs" and path.suffix == ".py":
                continue
            if "__pycache__" in path.parts:
                continue
            if source.name == "stdlib" and "site-packages" in path.relative_to(root).parts:
                continue
            group = _group(source, root, path)
            if group:
                out.append((group, path, f"{source.name}:{path}"))
    out.sort(key=lambda g: (_hash01(g[2]), g[2]))
    return out


def _read_text(path: Path) -> str | None:
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError):
            return None
    if len(raw) > MAX_FILE_BYTES or b"\x00" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def collect(spec: DataSpec) -> tuple[dict, dict[str, list[str]]]:
    """(manifest without token counts, split -> document texts in manifest order)."""
    manifest = {"python": sys.version.split()[0], "heldout_fraction": spec.heldout_fraction, "sources": {}}
    docs: dict[str, list[str]] = {"train": [], "heldout": []}
    for source in spec.sources:
        files = _files(source)
        groups = sorted({g for g, _, _ in files})
        held = {g for g in groups if _hash01(f"{source.name}:{g}") < spec.heldout_fraction}
        if groups and not held:  # every source holds out at least one whole group
            held = {min(groups, key=lambda g: _hash01(f"{source.name}:{g}"))}
        entries, used = [], {"train": 0, "heldout": 0}
        cap = {"train": source.max_bytes, "heldout": max(source.max_bytes // 10, 1)}
        for group, path, _ in files:
            split = "heldout" if group in held else "train"
            if used[split] >= cap[split]:
                continue
            text = _read_text(path)
            if not text or not text.strip():
                continue
            data = text.encode()
            used[split] += len(data)
            docs[split].append(text)
            entries.append([str(path), len(data), hashlib.sha256(data).hexdigest(), split, group])
        manifest["sources"][source.name] = {
            "roots": [str(r) for r in source.roots],
            "suffixes": list(source.suffixes),
            "max_bytes": source.max_bytes,
            "heldout_groups": sorted(held),
            "files": entries,
        }
    for split, count, seed in (
        ("train", spec.arithmetic_train, spec.seed),
        ("heldout", spec.arithmetic_heldout, spec.seed + 1),
    ):
        probs = arithmetic.problems(seed, count, split == "heldout", spec.heldout_fraction)
        docs[split] += [p["text"] for p in probs]
    manifest["arithmetic"] = {
        "generator": arithmetic.GENERATOR,
        "train": {"seed": spec.seed, "count": spec.arithmetic_train},
        "heldout": {"seed": spec.seed + 1, "count": spec.arithmetic_heldout},
    }
    return manifest, docs


def tokenize(texts: list[str], tokenizer_file: str | Path, batch: int = 512) -> np.ndarray:
    """All documents as one uint32 stream, each `BOS ids EOS` (the chat-rendered ones carry their own)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    parts = []
    for i in range(0, len(texts), batch):
        for enc in tok.encode_batch(texts[i : i + batch], add_special_tokens=False):
            ids = enc.ids
            if ids and ids[0] == BOS_ID:
                parts.append(np.asarray(ids, dtype=np.uint32))
            else:
                parts.append(np.asarray([BOS_ID, *ids, EOS_ID], dtype=np.uint32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


def build(spec: DataSpec, out_dir: str | Path, tokenizer_file: str | Path) -> dict:
    """Collect, shuffle documents (seeded), tokenise; write `train.npy`, `heldout.npy`, `manifest.json`,
    `heldout_arithmetic.jsonl` (eval-harness tasks: `benchmark id problem answer`). Returns the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest, docs = collect(spec)
    rng = np.random.default_rng(spec.seed)
    manifest["tokenizer_sha256"] = hashlib.sha256(Path(tokenizer_file).read_bytes()).hexdigest()
    manifest["tokens"] = {}
    for split, texts in docs.items():
        order = rng.permutation(len(texts)) if split == "train" else np.arange(len(texts))
        stream = tokenize([texts[i] for i in order], tokenizer_file)
        np.save(out / f"{split}.npy", stream)
        manifest["tokens"][split] = int(stream.size)
    held = arithmetic.problems(spec.seed + 1, spec.arithmetic_heldout, True, spec.heldout_fraction)
    with open(out / "heldout_arithmetic.jsonl", "w") as f:
        for p in held:
            f.write(
                json.dumps(
                    {"benchmark": "aime", "id": p["id"], "problem": p["problem"], "answer": p["answer"]}
                )
                + "\n"
            )
    (out / "manifest.json").write_text(json.dumps(manifest) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> None:
    import argparse
    import time

    p = argparse.ArgumentParser(description="Build deepinfer-tiny's training data from this machine.")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", required=True, help="tokenizer.json")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every source's byte cap")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    t0 = time.time()
    spec = DataSpec(machine_sources(a.scale), seed=a.seed)
    m = build(spec, a.out, a.tokenizer)
    files = {k: len(v["files"]) for k, v in m["sources"].items()}
    print(json.dumps({"tokens": m["tokens"], "files": files, "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()

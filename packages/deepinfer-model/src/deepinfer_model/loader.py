"""Read a DeepSeek checkpoint: one or many safetensors files (+ `model.safetensors.index.json`).

Files are opened lazily (safetensors memory-maps them); headers are checked against the expected
layout first and every problem - missing, unexpected, mis-shaped or mis-typed tensors, missing shards,
unreadable files - is reported at once in one `CheckpointError`, each line naming the tensor (or file)
with what was expected and what was found. Quantised tensors are dequantised on load.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .layout import TensorSpec
from .quant import MXFP4_BLOCK, dequant_fp8_block, dequant_mxfp4

INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("BF16", "F16", "F32")
SCALE_DTYPES = ("F8_E8M0", "F32")
INDEX_DTYPES = ("I32", "I64")
# Tensors real checkpoints carry that the stateless V4 model does not use (the MTP draft blocks).
IGNORED_PREFIXES = ("mtp.",)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; `problems` lists every mismatch, one line each."""

    def __init__(self, path: Path | str, problems: list[str]):
        self.problems = list(problems)
        lines = "\n  ".join(self.problems)
        super().__init__(f"checkpoint {path} has {len(self.problems)} problem(s):\n  {lines}")


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    key: str  # name inside the file (may carry the optional `model.` prefix)
    dtype: str
    shape: tuple[int, ...]


def _canonical(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


class CheckpointFiles:
    """Name -> stored tensor over every shard of a checkpoint directory (headers only; data stays on disk)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.problems: list[str] = []
        self.tensors: dict[str, StoredTensor] = {}
        self._handles: dict[Path, object] = {}
        if not self.path.is_dir():
            raise FileNotFoundError(f"checkpoint directory {self.path} does not exist")
        index = self.path / INDEX_FILE
        if index.exists():
            self._from_index(index)
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                self.problems.append(f"no *.safetensors files and no {INDEX_FILE} in {self.path}")
            for f in files:
                self._scan(f, None)

    def _from_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (json.JSONDecodeError, KeyError, AssertionError, TypeError) as e:
            self.problems.append(f"{INDEX_FILE}: not a valid index with a 'weight_map' object ({e})")
            return
        by_file: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_file.setdefault(shard, []).append(name)
        seen: dict[str, str] = {}
        for name in weight_map:
            canon = _canonical(name)
            if canon in seen:
                self.problems.append(
                    f"{INDEX_FILE}: tensor '{canon}' listed twice ('{seen[canon]}' and '{name}')"
                )
            seen[canon] = name
        for shard, names in sorted(by_file.items()):
            file = self.path / shard
            if not file.exists():
                self.problems.append(
                    f"shard '{shard}' listed in {INDEX_FILE} does not exist ({len(names)} tensors)"
                )
                continue
            self._scan(file, set(names))

    def _scan(self, file: Path, indexed: set[str] | None) -> None:
        try:
            with safe_open(file, framework="pt") as f:
                keys = list(f.keys())
                for key in keys:
                    sl = f.get_slice(key)
                    self._add(StoredTensor(file, key, sl.get_dtype(), tuple(sl.get_shape())))
        except Exception as e:  # safetensors raises its own error type for corrupt headers / truncated files
            self.problems.append(f"file '{file.name}' is not a readable safetensors file: {e}")
            return
        if indexed is not None:
            for name in sorted(indexed - set(keys)):
                self.problems.append(
                    f"tensor '{name}' is indexed in shard '{file.name}' but not stored there"
                )

    def _add(self, t: StoredTensor) -> None:
        canon = _canonical(t.key)
        if canon in self.tensors:
            other = self.tensors[canon]
            self.problems.append(
                f"tensor '{canon}' stored twice ('{other.key}' in {other.file.name}, '{t.key}' in {t.file.name})"
            )
            return
        self.tensors[canon] = t

    def read(self, name: str) -> torch.Tensor:
        """One tensor's data (the file stays memory-mapped; opened once per shard)."""
        t = self.tensors[name]
        if t.file not in self._handles:
            self._handles[t.file] = safe_open(t.file, framework="pt")
        return self._handles[t.file].get_tensor(t.key)

    def close(self) -> None:
        self._handles.clear()


# Kind of FP8 tensors scaled per row in 1 x 32 groups (V4.1's Engram tables) instead of 2-D weight blocks.
FP8_ROWS = "fp8_rows"


def _fp8_block(spec: TensorSpec, cfg: ModelConfig) -> tuple[int, int]:
    return (1, MXFP4_BLOCK) if spec.kind == FP8_ROWS else cfg.quant.weight_block_size


def _expected_storage(
    spec: TensorSpec, cfg: ModelConfig
) -> list[tuple[str, tuple[str, ...], tuple[int, ...]]]:
    """(name, allowed dtypes, shape) of the stored tensor(s) for one logical tensor."""
    q = cfg.quant
    if spec.kind == "f32":
        return [(spec.name, ("F32",), spec.shape)]
    if spec.kind == "index":
        return [(spec.name, INDEX_DTYPES, spec.shape)]
    if spec.kind == "float" or q is None:
        return [(spec.name, FLOAT_DTYPES, spec.shape)]
    scale_name = spec.name.removesuffix(".weight") + ".scale"
    rows, cols = spec.shape
    if spec.kind == "expert" and q.expert_dtype == "fp4":
        return [
            (spec.name, ("I8", "U8"), (rows, cols // 2)),
            (scale_name, ("F8_E8M0",), (rows, -(-cols // MXFP4_BLOCK))),
        ]
    b0, b1 = _fp8_block(spec, cfg)
    return [
        (spec.name, ("F8_E4M3",), spec.shape),
        (scale_name, SCALE_DTYPES, (-(-rows // b0), -(-cols // b1))),
    ]


def check_checkpoint(
    files: CheckpointFiles,
    layout: dict[str, TensorSpec],
    cfg: ModelConfig,
    ignored_prefixes: tuple[str, ...] = IGNORED_PREFIXES,
) -> list[str]:
    """Every mismatch between the stored tensors and the expected layout (empty list = loadable).

    Stored tensors outside the layout whose names start with one of `ignored_prefixes` are allowed.
    """
    problems = list(files.problems)
    expected_names: set[str] = set()
    for spec in layout.values():
        for name, dtypes, shape in _expected_storage(spec, cfg):
            expected_names.add(name)
            t = files.tensors.get(name)
            if t is None:
                problems.append(f"missing tensor '{name}': expected {'/'.join(dtypes)} {list(shape)}")
                continue
            if t.dtype not in dtypes:
                problems.append(f"tensor '{name}': expected dtype {'/'.join(dtypes)}, found {t.dtype}")
            if t.shape != shape:
                problems.append(f"tensor '{name}': expected shape {list(shape)}, found {list(t.shape)}")
    for name in sorted(set(files.tensors) - expected_names):
        if not name.startswith(ignored_prefixes):
            t = files.tensors[name]
            problems.append(f"unexpected tensor '{name}' ({t.dtype} {list(t.shape)}) in {t.file.name}")
    return problems


def load_tensors(
    path: str | Path,
    cfg: ModelConfig,
    layout: dict[str, TensorSpec],
    dtype: torch.dtype = torch.float32,
    progress: Callable[[Iterable], Iterable] | None = None,
    ignored_prefixes: tuple[str, ...] = IGNORED_PREFIXES,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Validate, then read and dequantise every tensor of `layout`.

    Float tensors become `dtype`; `f32` tensors stay FP32; index tables become int64. Each stored tensor
    is moved to `device` in its checkpoint format (FP8 / packed FP4 + scales) and dequantised there.
    Raises `CheckpointError` listing all problems before reading any data.
    """
    files = CheckpointFiles(path)
    problems = check_checkpoint(files, layout, cfg, ignored_prefixes)
    if problems:
        raise CheckpointError(path, problems)
    try:
        return _read_all(files, cfg, layout, dtype, progress, path, torch.device(device))
    finally:
        files.close()


def _read_all(
    files: CheckpointFiles,
    cfg: ModelConfig,
    layout: dict[str, TensorSpec],
    dtype: torch.dtype,
    progress: Callable[[Iterable], Iterable] | None,
    path: str | Path,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    specs = list(layout.values())
    for spec in progress(specs) if progress else specs:
        stored = _expected_storage(spec, cfg)
        tensor = files.read(stored[0][0]).to(device)
        if len(stored) == 2:  # quantised: weight + scale, dequantised on the device
            scale = files.read(stored[1][0]).to(device)
            if tensor.dtype in (torch.int8, torch.uint8):
                tensor = dequant_mxfp4(tensor, scale)
            else:
                tensor = dequant_fp8_block(tensor, scale, _fp8_block(spec, cfg))
        if spec.kind == "index":
            tensor = tensor.long()
            bad = (tensor < 0) | (tensor >= cfg.n_routed_experts)
            if bool(bad.any()):
                raise CheckpointError(
                    path, [f"tensor '{spec.name}': expert ids must lie in [0, {cfg.n_routed_experts})"]
                )
        elif spec.kind == "f32":
            tensor = tensor.float()
        else:
            tensor = tensor.to(dtype)
        out[spec.name] = tensor
    return out

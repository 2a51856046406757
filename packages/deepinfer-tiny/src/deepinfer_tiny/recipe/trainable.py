"""Trainable V4.1 weights: FP32 master tensors under the checkpoint's names, seen through their storage format.

Every forward reads each master tensor through `stored_value`: the value the checkpoint will hold after
quantisation (BF16 rounding, FP8 32x32 blocks, MXFP4 experts, FP8 rows for Engram tables), with a
straight-through gradient. Training is therefore quantisation-aware, and the model that is trained is
exactly the model the loader reads back: `save_checkpoint` writes `deepinfer_model`'s own quantised
tensors, and a loaded checkpoint gives the same logits as `TrainableV41.model()`.

The forward is `deepinfer_model`'s `DeepseekV41ForCausalLM` itself (the code the engine runs), built
afresh from the stored values for each step: its weight caches (`numerics.derived_weight`) key on tensor
identity and version, so fresh tensors never serve a copy made for another step.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from deepinfer_model import write_tokenizer as write_checkpoint_tokenizer
from deepinfer_model.training import (
    BF16,
    F32,
    FP4,
    FP8,
    FP8_ROWS,
    INDEX_FILE,
    CompressedVocabulary,
    DeepseekV41Config,
    DeepseekV41ForCausalLM,
    V41Weights,
    checkpoint_layout,
    dequant_fp8_block,
    dequant_mxfp4,
    quant_fp8_block,
    quant_mxfp4,
    quantised_v41_tensors,
    random_v41_tensors,
)
from safetensors.torch import save_file

# Stored in the checkpoint (the loader requires them) but read by no text forward.
UNUSED = ("image_start", "image_end", "image_newline")
SHARD_LIMIT = 16 * 2**20 - 2**16  # bytes per safetensors shard (the device link returns files < 16 MiB)


def stored_value(master: torch.Tensor, kind: str, block: tuple[int, int]) -> torch.Tensor:
    """The FP32 value the loader gives back for `master` stored as `kind`; gradient straight through."""
    with torch.no_grad():
        if kind == F32:
            return master
        if kind == BF16:
            value = master.to(torch.bfloat16).float()
        elif kind == FP4:
            value = dequant_mxfp4(*quant_mxfp4(master))
        elif kind in (FP8, FP8_ROWS):
            b = (1, 32) if kind == FP8_ROWS else block
            value = dequant_fp8_block(*quant_fp8_block(master, b), b)
        else:
            raise ValueError(f"unknown storage kind {kind!r}")
    return master + (value - master).detach() if master.requires_grad else value


class TrainableV41:
    """FP32 master weights (name -> tensor, `requires_grad` for the trained ones) of one V4.1 config."""

    def __init__(self, config: dict, masters: dict[str, torch.Tensor], vocab: CompressedVocabulary | None):
        self.config = config
        self.cfg = DeepseekV41Config.from_dict(config)
        self.layout = checkpoint_layout(self.cfg)
        missing = set(self.layout) - set(masters)
        if missing:
            raise ValueError(f"master weights lack {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        self.masters = masters
        self.vocab = vocab
        self.block = tuple(self.cfg.quant.weight_block_size)

    @classmethod
    def initialise(
        cls, config: dict, vocab: CompressedVocabulary | None, seed: int, device: torch.device | str
    ) -> TrainableV41:
        """Fresh weights: `deepinfer_model`'s random V4.1 init (its mHC biases start near the identity
        schedule), the output projections of each sub-layer scaled down so a deep trunk starts stable."""
        cfg = DeepseekV41Config.from_dict(config)
        masters = random_v41_tensors(cfg, seed, device)
        for name, t in masters.items():
            if name.endswith(("attn.wo_b.weight", "w2.weight")):
                t.mul_(0.5)
            if name == "head.weight":
                t.mul_(0.5)
        return cls(config, masters, vocab)

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: torch.device | str = "cpu") -> TrainableV41:
        """Masters from a checkpoint (its stored values, dequantised); Engram's vocabulary from its tokenizer."""
        from deepinfer_model.training import ignored_prefixes, load_tensors

        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        cfg = DeepseekV41Config.from_dict(config)
        layout = checkpoint_layout(cfg)
        masters = load_tensors(
            path, cfg, layout, torch.float32, ignored_prefixes=ignored_prefixes(cfg), device=device
        )
        vocab = CompressedVocabulary.from_file(path) if cfg.engram else None
        return cls(config, masters, vocab)

    def train_only(self, names: Iterable[str]) -> list[torch.Tensor]:
        """Mark exactly `names` as trained (the rest frozen); returns their tensors."""
        chosen = set(names)
        for name, t in self.masters.items():
            t.requires_grad_(name in chosen)
        return [self.masters[n] for n in self.layout if n in chosen]

    def backbone_names(self) -> list[str]:
        return [n for n in self.layout if not n.startswith("mtp.") and n not in UNUSED]

    def drafter_names(self) -> list[str]:
        return [n for n in self.layout if n.startswith("mtp.")]

    def stored_values(self, quantised: bool = True) -> dict[str, torch.Tensor]:
        """Each tensor as the checkpoint stores it; `quantised=False`: the master tensors themselves (the
        model before its storage rounding, to measure what that rounding costs)."""
        if not quantised:
            return dict(self.masters)
        return {n: stored_value(self.masters[n], spec.kind, self.block) for n, spec in self.layout.items()}

    def weights(self, with_drafter: bool = True, quantised: bool = True) -> V41Weights:
        """`V41Weights` of this step's stored values (the drafter's only where asked: the base stage skips it);
        `quantised=False` reads the masters as they are (see `stored_values`)."""
        values = self.stored_values(quantised)
        w = V41Weights.from_tensors(self.cfg, values.__getitem__)
        if not with_drafter:
            w.drafter = None
        return w

    def model(
        self, act_dtype: torch.dtype, with_drafter: bool = True, moe_fn=None, quantised: bool = True
    ) -> DeepseekV41ForCausalLM:
        return DeepseekV41ForCausalLM(
            self.cfg, self.weights(with_drafter, quantised), self.vocab, act_dtype=act_dtype, moe_fn=moe_fn
        )

    def save_checkpoint(self, path: str | Path, tokenizer_dir: str | Path) -> list[Path]:
        """Write config.json, the quantised tensors in shards below `SHARD_LIMIT` bytes plus their index, and
        the tokenizer files of `tokenizer_dir`; returns the files written."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with torch.no_grad():
            values = {n: t.detach().float() for n, t in self.masters.items()}
            tensors = {n: t.contiguous().cpu() for n, t in quantised_v41_tensors(self.cfg, values).items()}
        shards: list[dict[str, torch.Tensor]] = [{}]
        used = 0
        for name, t in tensors.items():
            size = t.numel() * t.element_size()
            if size > SHARD_LIMIT:
                raise ValueError(f"tensor {name} ({size} bytes) exceeds the shard limit {SHARD_LIMIT}")
            if used + size > SHARD_LIMIT:
                shards.append({})
                used = 0
            shards[-1][name] = t
            used += size
        written = []
        weight_map = {}
        for i, part in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(part, path / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
            written.append(path / file)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (path / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        written += [path / INDEX_FILE, path / "config.json"]
        written += write_tokenizer(path, tokenizer_dir)
        return written


def write_tokenizer(path: Path, tokenizer_dir: str | Path) -> list[Path]:
    """tokenizer.json as it is, tokenizer_config.json with the engine's chat template (the format the eval
    harness prompts in, `recipe.arithmetic`)."""
    return write_checkpoint_tokenizer(path, tokenizer_dir)

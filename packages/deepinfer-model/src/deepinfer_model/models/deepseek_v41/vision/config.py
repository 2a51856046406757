"""`vision_config` of a V4.1 checkpoint: the DeepSeek-ViT encoder and the aligner that feeds the text model.

The spec documents two keys (`hidden_size`, `downsample_ratio`), read by the projector. A checkpoint that
ships the vision tower also describes the encoder (`num_hidden_layers`, `num_attention_heads`,
`intermediate_size`, ...); a `vision_config` without `num_hidden_layers` describes no tower, and such a
checkpoint loads as the text model alone (its `vision.*` / `aligner.*` tensors, if any, are ignored).
Defaults are V4.1-Flash's: 14-pixel patches of 3 channels, 2D RoPE theta 10000, 1,024 tokens per image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_PREFIX = "vision_config."


def _bad(key: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"config key {_PREFIX + key!r} = {value!r}: {rule}")


def _int(d: dict, key: str, default: int | None = None, lo: int = 1) -> int:
    if key not in d:
        if default is None:
            raise ValueError(f"config key {_PREFIX + key!r} is missing: a vision tower needs it")
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _bad(key, v, f"must be an integer >= {lo}")
    return v


def _float(d: dict, key: str, default: float) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
        raise _bad(key, v, "must be a number > 0")
    return float(v)


def _triple(d: dict, key: str, default: tuple[float, float, float], positive: bool) -> tuple[float, ...]:
    v = d.get(key, list(default))
    ok = isinstance(v, list | tuple) and len(v) == 3
    ok = ok and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v)
    if not ok or (positive and any(x <= 0 for x in v)):
        rule = "a list of 3 numbers" + (" > 0" if positive else "")
        raise _bad(key, v, f"must be {rule} (one per RGB channel)")
    return tuple(float(x) for x in v)


@dataclass(frozen=True)
class VisionConfig:
    """The encoder ("DeepSeek-ViT") and aligner settings.

    `hidden_size` is the encoder width; `downsample_ratio` the side of the pixel-unshuffle that merges
    `downsample_ratio**2` neighbouring patches into one language-model position.
    """

    hidden_size: int
    downsample_ratio: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int = 14
    num_channels: int = 3
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_image_tokens: int = 1024  # language-model positions per image (start, rows, newlines, end)
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch: channels x patch x patch, flattened channel-major."""
        return self.num_channels * self.patch_size * self.patch_size

    @property
    def merged_pixels(self) -> int:
        """Side in pixels of the square one language-model image position covers."""
        return self.patch_size * self.downsample_ratio


def parse_vision_config(cfg: dict) -> VisionConfig | None:
    """The vision tower `cfg["vision_config"]` describes, or None when it describes none (see module doc)."""
    v = cfg.get("vision_config")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError(f"config key 'vision_config' = {v!r}: must be an object or null")
    if "num_hidden_layers" not in v:
        return None
    width = _int(v, "hidden_size")
    heads = _int(v, "num_attention_heads")
    if width % heads or (width // heads) % 4:
        raise _bad(
            "num_attention_heads",
            heads,
            f"must divide hidden_size = {width} into heads whose width is a multiple of 4 "
            "(axial 2D RoPE rotates pairs along rows and along columns)",
        )
    out = VisionConfig(
        hidden_size=width,
        downsample_ratio=_int(v, "downsample_ratio"),
        num_hidden_layers=_int(v, "num_hidden_layers"),
        num_attention_heads=heads,
        intermediate_size=_int(v, "intermediate_size"),
        patch_size=_int(v, "patch_size", 14),
        num_channels=_int(v, "num_channels", 3),
        rope_theta=_float(v, "rope_theta", 10000.0),
        rms_norm_eps=_float(v, "rms_norm_eps", 1e-6),
        max_image_tokens=_int(v, "max_image_tokens", 1024, lo=4),
        image_mean=_triple(v, "image_mean", (0.5, 0.5, 0.5), positive=False),
        image_std=_triple(v, "image_std", (0.5, 0.5, 0.5), positive=True),
    )
    if out.num_channels != 3:
        raise _bad("num_channels", out.num_channels, "must be 3 (RGB)")
    return out

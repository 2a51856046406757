"""Builders shared by the tests of requests with images (a distinct module name: several packages have a
conftest.py, so tests never import `conftest` by name)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import torch
from PIL import Image


def png(seed: int, size=(56, 56)) -> bytes:
    """A PNG of random pixels, `size` = (width, height), the same bytes for the same seed."""
    g = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(size[1], size[0], 3, generator=g) * 255).to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def make_vision_checkpoint(path: Path) -> Path:
    """The tiny V4.1 with its small vision tower; its chat template is plain text, because the real one's
    role tokens lie outside the tiny 256-token vocabulary."""
    from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint, tiny_v41_config_dict

    path = make_v41_checkpoint(path, tiny_v41_config_dict(vision_tower=True))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}!{% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path

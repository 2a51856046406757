"""Helpers shared by this package's tests (a distinct module name: several packages have a conftest.py,
so tests never import `conftest` by name)."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
import textwrap

# Makes torch and deepinfer look uninstalled: every meta-path finder answers "not found" for
# them, so importlib.util.find_spec() returns None and an import raises ModuleNotFoundError,
# exactly as in an environment where only deepinfer-eval and its dependencies are installed.
HIDE = textwrap.dedent("""
    import importlib.util, sys
    HIDDEN = ("torch", "deepinfer")

    class Hidden:
        def __init__(self, inner):
            self._inner = inner
        def __getattr__(self, name):
            return getattr(self._inner, name)
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in HIDDEN:
                return None
            find = getattr(self._inner, "find_spec", None)
            return find(name, path, target) if find else None

    for name in [m for m in sys.modules if m.partition(".")[0] in HIDDEN]:
        del sys.modules[name]
    sys.meta_path[:] = [Hidden(f) for f in sys.meta_path]
    assert importlib.util.find_spec("torch") is None
    try:
        import torch
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("torch is still importable")
""")

CHECK = textwrap.dedent("""
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in HIDDEN)
    assert not loaded, loaded
""")


def run_without_engine(code: str, cwd) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter where torch and deepinfer cannot be imported (and check that it
    loaded neither)."""
    return subprocess.run(
        [sys.executable, "-c", HIDE + code + CHECK], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def png(color, size=(30, 20)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def write_upstream_hle(path, rows: list[dict], image_feature: bool = False):
    """A parquet file in the upstream HLE test split's layout, written by `datasets`: `image` a data: URL
    string ("" for a text task; or, `image_feature`, an Image column as a re-saved copy may have it), beside
    the Image columns `image_preview` / `rationale_image` and the other text columns."""
    from datasets import Dataset, Features, Image, Value

    text = ("id", "question", "answer", "answer_type", "author_name", "rationale", "raw_subject", "category")
    features = {name: Value("string") for name in text}
    features |= {"image": Image() if image_feature else Value("string")}
    features |= {"image_preview": Image(), "rationale_image": Image(), "canary": Value("string")}
    full = []
    for r in rows:
        image = r.get("image", "")
        preview = None
        if image:
            raw = base64.b64decode(image.partition(",")[2])
            preview = {"bytes": raw, "path": None}
            if image_feature:
                image = {"bytes": raw, "path": None}
        elif image_feature:
            image = None
        full.append(
            {
                **{name: r.get(name, "") for name in text},
                "image": image,
                "image_preview": preview,
                "rationale_image": None,
                "canary": "canary string",
            }
        )
    Dataset.from_list(full, features=Features(features)).to_parquet(str(path))
    return path

"""HLE task images: kept in the task file as `data:` URLs (as the upstream `image` column holds them) and
sent to the engine as an OpenAI-style `image_url` content part.

Upstream HLE stores each image as a string `data:image/<type>;base64,<data>` ("" for a text task). A copy
whose `image` column was re-saved as a `datasets` Image feature gives `{"bytes": ..., "path": ...}`, and
raw bytes are accepted too; both become a data URL. Convert decodes every image with Pillow once (imported
lazily), so an undecodable one is reported with its task's id instead of failing its requests later.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings


def image_data_url(value, label: str) -> str:
    """The data URL of a task's image given as a data URL, bytes or an Image-feature dict ("" for none);
    ValueError naming `label` when it is not an image Pillow can decode."""
    if value is None or value == "":
        return ""
    if isinstance(value, dict):
        value = value.get("bytes")
        if not value:
            raise ValueError(f"{label}: an image dict must hold its 'bytes'")
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        return f"data:image/{_decoded_format(data, label)};base64,{base64.b64encode(data).decode()}"
    if not isinstance(value, str):
        raise ValueError(f"{label}: must be a data: URL, image bytes or empty, got {type(value).__name__}")
    _decoded_format(image_bytes(value, label), label)
    return value


def image_bytes(url: str, label: str) -> bytes:
    """The bytes a `data:<type>;base64,<data>` URL holds; ValueError naming `label` otherwise."""
    if not isinstance(url, str) or not url.startswith("data:"):
        shown = url[:40] if isinstance(url, str) else type(url).__name__
        raise ValueError(f"{label}: must be a data: URL ('data:image/<type>;base64,...'), got {shown!r}")
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError(f"{label}: a data: URL must be 'data:<type>;base64,<data>', got {header[:40]!r}")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{label}: the data: URL's base64 content does not decode ({e})") from None
    if not data:
        raise ValueError(f"{label}: the data: URL holds no bytes")
    return data


def image_digest(url: str) -> str:
    """sha256 of the image's bytes: names the image in generation lines without repeating it."""
    return hashlib.sha256(image_bytes(url, "image")).hexdigest()


def _decoded_format(data: bytes, label: str) -> str:
    """Pillow's format name of fully decodable image bytes, lower case ("png", "jpeg", ...)."""
    try:
        from PIL import Image
    except ImportError as e:  # a dependency of deepinfer-eval; only a broken install lacks it
        raise ImportError("checking HLE images needs Pillow: pip install pillow") from e
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # large scans are real tasks
            with Image.open(io.BytesIO(data)) as img:
                img.load()
                fmt = img.format or "png"
                width, height = img.size
    except Exception as e:  # Pillow raises several types for undecodable input
        raise ValueError(f"{label}: the image does not decode ({type(e).__name__}: {e})") from None
    if width < 1 or height < 1:
        raise ValueError(f"{label}: the image is {width} x {height} pixels (empty)")
    return fmt.lower()

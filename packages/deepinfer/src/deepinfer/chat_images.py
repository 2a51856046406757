"""OpenAI-style chat content parts with images, for `LLM.chat`.

A message's `content` may be a list of parts: `{"type": "text", "text": ...}` and
`{"type": "image_url", "image_url": {"url": ...}}` (or `"image_url": "..."`). Each image part becomes an
`<image>` placeholder in the message's text, and its image the next entry of the request's
`multi_modal_data["image"]`. A URL is a `data:` URL with base64 content, a `file://` URL or a local path;
remote URLs are refused (the engine does not fetch).
"""

from __future__ import annotations

import base64
import binascii
from urllib.parse import unquote, urlparse

from .engine.images import IMAGE_PLACEHOLDER


def image_from_url(url, label: str) -> bytes | str:
    """The image a URL names: decoded bytes of a `data:` URL, or the path of a `file://` URL or plain path."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{label}: the image URL must be a non-empty string, got {url!r}")
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ValueError(f"{label}: a data: URL must be 'data:<type>;base64,<data>'")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"{label}: the data: URL's base64 content does not decode ({e})") from None
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return unquote(parsed.path)
    if parsed.scheme in ("http", "https", "ftp"):
        raise ValueError(
            f"{label}: remote image URLs are not fetched ({parsed.scheme}://); pass a data: URL or a local path"
        )
    return url


def split_image_parts(messages: list[dict], where: str = "messages") -> tuple[list[dict], list]:
    """The messages with list contents joined to text (an `<image>` per image part) and the images in order."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        text = []
        for j, part in enumerate(content):
            label = f"{where}[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text.append(str(part.get("text", "")))
            elif kind == "image_url":
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                images.append(image_from_url(url, label))
                text.append(IMAGE_PLACEHOLDER)
            else:
                raise ValueError(
                    f"{label}: a content part must have type 'text' or 'image_url', got {kind!r}"
                )
        out.append({**m, "content": "".join(text)})
    return out, images

"""Requests with images: `multi_modal_data={"image": [...]}` turned into an expanded prompt and the
image embeddings its prefill needs.

At admission each image is read (bytes, a PIL image or a file path), preprocessed in worker processes
(`ImagePreprocessor`) and run through the model's vision tower once; embeddings are kept by content hash
(`EncoderCache`), so an image sent in many requests is encoded once. The prompt text is split on the
`<image>` placeholder (not one token in the tokenizer) and each placeholder takes the next image's block of
sentinel ids (`expand_images`); placeholders past the last image stay text. A token prompt marks each image
by one `placeholder_id` (the IMAGE sentinel), as many as there are images. The request's prefix-cache salt
is derived from its images' digests, so requests share cached blocks only when their images are the same.

Reading and preprocessing (Pillow decoding, resizing, normalising: the slow part) can happen before
admission, off the engine's thread: `ImageInputs.prepare(multi_modal_data)` returns `PreparedImages`, which
`prompt` (and so `LLMEngine.add_request`) takes in place of the dict; only the vision tower's run and the
expansion are left for admission. `AsyncLLM` prepares every request's images this way, so its step loop
keeps stepping while an image decodes; `LLM.generate` prepares all of a call's images in one batch
(`prepare_many`: the workers stay busy across requests, an image many requests carry is preprocessed once). The prepared path and the direct one give the same ids and
embeddings, and raise the same errors in the same order.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from deepinfer_model import (
    EncoderCache,
    ImageError,
    ImagePreprocessor,
    ImageSentinels,
    compression_stride,
    expand_images,
    image_digest,
    image_grid_of,
    parse_vision_config,
)

from .request_checks import checked_token_id

__all__ = [
    "IMAGE_PLACEHOLDER",
    "ImageInputs",
    "ImagePreparer",
    "ImagePrompt",
    "PreparedImages",
    "image_bytes",
]

IMAGE_PLACEHOLDER = "<image>"


@dataclass(eq=False)
class ImagePrompt:
    """One request's expanded prompt: `ids` (with sentinel ids), `features` [cells, H] of its images in
    order, `rows[p]` = the feature row of position p (-1: not an image position), the image digests."""

    ids: list[int]
    features: torch.Tensor
    rows: np.ndarray
    sentinel: np.ndarray  # bool per position: inside an image block (a sentinel id the expansion wrote)
    digests: list[str]

    def step_features(self, start: int, stop: int) -> torch.Tensor | None:
        """The embeddings of the image positions in [start, stop) (possibly none: [0, H]), or None when
        those positions hold no sentinel id."""
        stop = min(stop, len(self.ids))
        if start >= stop or not self.sentinel[start:stop].any():
            return None
        r = self.rows[start:stop]
        return self.features[torch.as_tensor(r[r >= 0])]

    @classmethod
    def handed_off(cls, ids: list[int], sentinel_positions: list[int], digests: list[str], width: int):
        """The image facts a COMPLETION engine keeps of a prompt another engine prefilled with images: its
        sentinel positions (allowed ids there) and image digests (its prefix-cache namespace); no
        embeddings (it computes only the prompt's last token, an image end or text, again)."""
        sentinel = np.zeros(len(ids), dtype=bool)
        sentinel[np.asarray(sentinel_positions, dtype=np.int64)] = True
        rows = np.full(len(ids), -1, dtype=np.int64)
        return cls(list(ids), torch.empty(0, width), rows, sentinel, list(digests))

    def handoff_meta(self) -> dict:
        """What `handed_off` rebuilds this from (a hand-off record's `meta["images"]`)."""
        return {"sentinel_positions": np.flatnonzero(self.sentinel).tolist(), "digests": list(self.digests)}

    def cache_salt(self, base: int) -> int:
        """A prefix-cache namespace in [0, 2**63) for this request's images on top of `base`."""
        key = f"{base}:" + ",".join(self.digests)
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & (2**63 - 1)


@dataclass(eq=False)
class PreparedImages:
    """One request's `multi_modal_data` read and preprocessed ahead of admission (`ImageInputs.prepare`).
    Errors are kept, not raised, so that admission raises them where the direct path would: `error` (the
    dict itself is malformed), per image its bytes or the error reading them, and its `PreparedImage`, the
    error preprocessing it, or None (not preprocessed: the encoder cache held it when prepared, or another
    image of the request could not be read)."""

    images: list
    data: list[bytes | ImageError]
    prepared: list  # per image: deepinfer_model's PreparedImage, an ImageError, or None
    error: ValueError | None = None


def image_bytes(item, label: str) -> bytes:
    """The encoded bytes of one image given as bytes, a PIL image or a file path."""
    if isinstance(item, bytes | bytearray | memoryview):
        return bytes(item)
    if isinstance(item, str | Path):
        try:
            return Path(item).read_bytes()
        except OSError as e:
            raise ImageError(f"{label}: cannot read the image file {str(item)!r} ({e.strerror})") from None
    if type(item).__module__.startswith("PIL."):
        buf = io.BytesIO()
        item.save(buf, format="PNG")  # lossless, so the pixels are the ones given
        return buf.getvalue()
    raise ImageError(
        f"{label}: an image must be bytes, a PIL image or a file path, got {type(item).__name__}"
    )


class ImagePreparer:
    """Reads and preprocesses requests' images (`prepare`, `prepare_many`) for a vision tower of config
    `vision_config` (None: a model without one) in a pool of `workers` processes started on the first
    image: what admission needs ahead of it, and all a front whose ranks encode the images does."""

    def __init__(self, vision_config, workers: int = 2) -> None:
        self.vision_config = vision_config
        self.workers = workers
        self._pre = None

    @classmethod
    def for_checkpoint(cls, path: Path, workers: int = 2) -> ImagePreparer:
        """The preparer for the vision tower a checkpoint's config.json describes (a front, which loads
        no model)."""
        return cls(parse_vision_config(json.loads((Path(path) / "config.json").read_text())), workers)

    @property
    def preprocessor(self) -> ImagePreprocessor:
        """The worker pool that decodes and preprocesses images (created on first use)."""
        if self._pre is None:
            self._pre = ImagePreprocessor(self.vision_config, workers=self.workers)
        return self._pre

    def prepare(self, multi_modal_data) -> PreparedImages:
        """Read and preprocess a request's images without touching engine state (safe on another thread
        while the engine steps; see the module doc)."""
        return self.prepare_many([multi_modal_data])[0]

    def prepare_many(self, requests: list, on_done=None, cached=None) -> list[PreparedImages]:
        """`prepare` for many requests' `multi_modal_data` at once: their images go to the worker pool
        together (the workers stay busy across requests) and an image that several requests carry at the
        same place is preprocessed once; an image whose digest `cached` holds (an encoder cache) is not.
        on_done(n): n more images preprocessed (a progress bar)."""
        out: list[PreparedImages] = []
        todo: dict[tuple[str, str], bytes] = {}  # (digest, label) -> bytes: each preprocessed once
        wanted: list[tuple[int, int, tuple[str, str]]] = []  # (request, image, key)
        for r, multi_modal_data in enumerate(requests):
            try:
                images = images_of(multi_modal_data)
            except ValueError as e:
                out.append(PreparedImages([], [], [], e))
                continue
            labels = image_labels(len(images))
            data: list[bytes | ImageError] = []
            for item, label in zip(images, labels, strict=True):
                try:
                    data.append(image_bytes(item, label))
                except ImageError as e:
                    data.append(e)
            out.append(PreparedImages(images, data, [None] * len(images)))
            if self.vision_config is None or not all(isinstance(b, bytes) for b in data):
                continue  # admission raises the first error (or the missing tower) before any preprocessing
            for i, (b, label) in enumerate(zip(data, labels, strict=True)):
                digest = image_digest(b)
                if cached is None or digest not in cached:
                    todo.setdefault((digest, label), b)
                    wanted.append((r, i, (digest, label)))
        if todo:
            keys = list(todo)
            done = self.preprocessor.prepare(
                [todo[k] for k in keys], [label for _, label in keys], on_done=on_done
            )
            by_key = dict(zip(keys, done, strict=True))
            for r, i, key in wanted:
                out[r].prepared[i] = by_key[key]
        return out

    def close(self) -> None:
        if self._pre is not None:
            self._pre.close()
            self._pre = None


def prepared_at_front(preparer: ImagePreparer, multi_modal_data) -> PreparedImages:
    """A front's part of a request with images (a data-parallel or disaggregated front; its engines expand
    and encode them): read and preprocessed (`multi_modal_data` may be the `PreparedImages` that `preparer`
    made of it), refused as one engine refuses them when they are added (no vision tower, a bad image:
    ValueError), the originals replaced by their bytes (what travels to the engine)."""
    prepared = multi_modal_data
    if not isinstance(prepared, PreparedImages):
        prepared = preparer.prepare(multi_modal_data)
    if prepared.error is not None:
        raise prepared.error
    if preparer.vision_config is None:
        raise no_vision_tower()
    for item in (*prepared.data, *prepared.prepared):
        if isinstance(item, ImageError):
            raise item
    return PreparedImages(list(prepared.data), prepared.data, prepared.prepared)


def image_tokens(prepared: PreparedImages) -> int:
    """The positions a request's preprocessed images take once expanded, without the alignment padding
    (at most a compression stride each): per image of rows x cols merged cells, rows * (cols + 1) + 2."""
    return sum(p.rows * (p.cols + 1) + 2 for p in prepared.prepared if p is not None)


def no_vision_tower() -> ValueError:
    """The error of a request with images for a model without a vision tower."""
    return ValueError(
        "multi_modal_data['image']: this model has no vision tower (its config has no "
        "vision_config with num_hidden_layers), so it cannot take images"
    )


class ImageInputs:
    """The engine's image path for `model` (see the module doc): an encoder cache of at most `cache_rows`
    embedding rows (`EngineArgs.encoder_cache_tokens`), `workers` preprocessing processes started on the
    first image."""

    def __init__(self, model, cache_rows: int, workers: int = 2) -> None:
        self.model = model
        self.vision = getattr(model, "vision", None)
        self.cache_rows = cache_rows
        self.preparer = ImagePreparer(None if self.vision is None else self.vision.config, workers)
        self._cache = None

    @property
    def encoder_cache(self):
        if self._cache is None:
            self._cache = EncoderCache(self.cache_rows)
        return self._cache

    @property
    def preprocessor(self) -> ImagePreprocessor:
        """The preparer's worker pool (created on first use)."""
        return self.preparer.preprocessor

    @property
    def placeholder_id(self) -> int:
        """The id that stands for one image in a token prompt (the IMAGE sentinel, `vocab_size + 2`)."""
        return ImageSentinels(int(self.model.config.vocab_size)).image

    def prepare(self, multi_modal_data) -> PreparedImages:
        """`ImagePreparer.prepare`; images the encoder cache holds are not preprocessed."""
        return self.prepare_many([multi_modal_data])[0]

    def prepare_many(self, requests: list, on_done=None) -> list[PreparedImages]:
        """`ImagePreparer.prepare_many`; images the encoder cache holds are not preprocessed."""
        # read only: admission, on the engine's thread, updates the cache
        return self.preparer.prepare_many(requests, on_done, cached=self._cache)

    def prompt(
        self, prompt: str | None, prompt_token_ids, multi_modal_data, encode, tokenizer
    ) -> ImagePrompt:
        """Expand a text `prompt` (its `<image>` placeholders) or, when given, `prompt_token_ids` (each
        `placeholder_id` one image) with the images; ValueError (an `ImageError` for a bad image) naming
        the problem. `encode(text)` tokenizes the first text segment (with BOS), `tokenizer` the later ones.
        `multi_modal_data` may be the `PreparedImages` that `prepare` made of it."""
        given = multi_modal_data if isinstance(multi_modal_data, PreparedImages) else None
        if given is not None and given.error is not None:
            raise given.error
        images = given.images if given is not None else images_of(multi_modal_data)
        if self.vision is None:
            raise no_vision_tower()
        vocab = int(self.model.config.vocab_size)
        if prompt_token_ids is not None:
            segments = self._token_segments(list(prompt_token_ids), len(images), vocab)
        elif isinstance(prompt, str):
            n_slots = prompt.count(IMAGE_PLACEHOLDER)
            if len(images) > n_slots:
                raise ValueError(
                    f"multi_modal_data['image'] has {len(images)} images but the prompt has {n_slots} "
                    f"{IMAGE_PLACEHOLDER} placeholders: each image needs one"
                )
            texts = prompt.split(IMAGE_PLACEHOLDER, len(images))
            segments = [encode(texts[0])]
            segments += [tokenizer.encode(t, add_special_tokens=False).ids for t in texts[1:]]
        else:
            raise ValueError(
                f"multi_modal_data needs a text prompt with {IMAGE_PLACEHOLDER} placeholders or "
                "prompt_token_ids with the image placeholder id"
            )

        labels = image_labels(len(images))
        if given is None:
            data = [image_bytes(item, label) for item, label in zip(images, labels, strict=True)]
        else:
            for b in given.data:
                if isinstance(b, ImageError):
                    raise b
            data = given.data
        embedded = self._embed(data, labels, None if given is None else given.prepared)
        cfg = self.model.config
        sentinels = ImageSentinels(vocab)
        ids, spans = expand_images(
            segments, [g for g, _ in embedded], compression_stride(cfg.compress_ratios), sentinels
        )
        in_image = np.zeros(len(ids), dtype=bool)  # (the engine checks every id outside the blocks)
        for span in spans:
            in_image[span.offset : span.end] = True
        arr = np.asarray(ids, dtype=np.int64)
        rows = np.full(len(ids), -1, dtype=np.int64)
        where = np.flatnonzero(in_image & (arr == sentinels.image))
        rows[where] = np.arange(len(where))
        feats = [f for _, f in embedded]
        width = int(self.model.weights.embed.shape[1])
        features = torch.cat(feats) if feats else torch.empty(0, width)
        digests = [image_digest(b) for b in data]
        return ImagePrompt(ids, features, rows, in_image, digests)

    def _token_segments(self, ids: list, n_images: int, vocab: int) -> list[list[int]]:
        """A token prompt split at its image placeholder ids, which must be as many as the images."""
        placeholder = self.placeholder_id
        segments: list[list[int]] = [[]]
        for i, t in enumerate(ids):
            if t == placeholder and not isinstance(t, bool):
                segments.append([])
                continue
            try:
                segments[-1].append(checked_token_id(f"prompt_token_ids[{i}]", t, vocab))
            except ValueError as e:
                raise ValueError(f"{e} (or {placeholder}, the image placeholder id)") from None
        if len(segments) - 1 != n_images:
            raise ValueError(
                f"multi_modal_data['image'] has {n_images} images but prompt_token_ids has "
                f"{len(segments) - 1} image placeholder ids ({placeholder}): each image needs one"
            )
        return segments

    def _embed(
        self, data: list[bytes], labels: list[str], given: list | None = None
    ) -> list[tuple[tuple[int, int], torch.Tensor]]:
        """Per image its grid (rows, cols) of merged cells and its embeddings [rows * cols, H]. `given`:
        the images preprocessed by `prepare`; one it left out and the cache no longer holds (evicted since)
        is preprocessed here."""
        cache, vcfg = self.encoder_cache, self.vision.config
        out: list = [None] * len(data)
        misses = []
        for i, b in enumerate(data):
            hit = cache.get(image_digest(b))
            if hit is not None:
                out[i] = (image_grid_of(b, vcfg, labels[i]), hit)
            else:
                misses.append(i)
        todo = [i for i in misses if given is None or given[i] is None]
        fresh = {}
        if todo:
            done = self.preprocessor.prepare([data[i] for i in todo], [labels[i] for i in todo])
            fresh = dict(zip(todo, done, strict=True))
        for i in misses:
            p = fresh[i] if i in fresh else given[i]
            if isinstance(p, ImageError):
                raise p
            patches = torch.from_numpy(p.patches).to(self.model.device)
            with torch.no_grad():
                emb = self.vision.embed_image(patches, p.patch_rows, p.patch_cols)
            cache.put(p.digest, emb)
            out[i] = ((p.rows, p.cols), emb)
        return out

    def close(self) -> None:
        self.preparer.close()


def check_takes_images(engine) -> None:
    """ValueError unless `engine` serves requests with images: it prepares them (`images`: an engine's
    `ImageInputs`, a data-parallel or disaggregated front's `ImagePreparer`)."""
    if getattr(engine, "images", None) is None:
        raise ValueError(f"multi_modal_data: images are not supported by {type(engine).__name__} yet")


def image_labels(count: int) -> list[str]:
    """The names errors give a request's images, in order."""
    return [f"multi_modal_data['image'][{i}]" for i in range(count)]


def images_of(multi_modal_data) -> list:
    """The images of a request's `multi_modal_data` (one item or a list); ValueError naming what is wrong."""
    if not isinstance(multi_modal_data, dict):
        raise ValueError(
            f"multi_modal_data must be a dict like {{'image': [...]}}, got {type(multi_modal_data).__name__}"
        )
    unknown = sorted(set(multi_modal_data) - {"image"})
    if unknown:
        raise ValueError(f"multi_modal_data: unknown modalities {unknown}; only 'image' is supported")
    images = multi_modal_data.get("image", [])
    if not isinstance(images, list | tuple):
        images = [images]
    if not images:
        raise ValueError("multi_modal_data['image'] must hold at least one image")
    return list(images)

"""Input embeddings of a sequence holding images: text rows from the embedding table, sentinel rows from the
vision path (`tokens.py`): aligned image features at IMAGE (images in order, cells row-major), the learned
start / newline / end embeddings, the text pad token's embedding at IMAGE_PAD."""

from __future__ import annotations

import torch

from ....numerics import carrier, round_to
from .tokens import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_PAD, IMAGE_START, NUM_IMAGE_SENTINELS


def image_input_embeddings(
    ids: torch.Tensor,
    table: torch.Tensor,
    image_embeds: torch.Tensor,
    pad_token_id: int,
    features: list[torch.Tensor],
    act_dtype: torch.dtype,
) -> torch.Tensor:
    """[T, H] in the carrier dtype. `features[i]` [cells_i, H] fills the IMAGE positions of the i-th image;
    their total must equal the number of IMAGE ids."""
    V = table.shape[0]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V + NUM_IMAGE_SENTINELS):
        raise ValueError(
            f"token_ids must lie in [0, vocab_size + {NUM_IMAGE_SENTINELS} = {V + NUM_IMAGE_SENTINELS}) "
            f"with images, got range [{int(ids.min())}, {int(ids.max())}]"
        )
    out = table[ids.clamp(max=V - 1)].to(carrier())
    kind = ids - V  # sentinel offset where >= 0
    for offset, row in (
        (IMAGE_START, image_embeds[0]),
        (IMAGE_NEW_LINE, image_embeds[1]),
        (IMAGE_END, image_embeds[2]),
    ):
        out[kind == offset] = row.to(out.dtype)
    out[kind == IMAGE_PAD] = table[pad_token_id].to(out.dtype)
    where = (kind == IMAGE).nonzero().flatten()
    n_rows = sum(int(f.shape[0]) for f in features)
    if n_rows != where.numel():
        raise ValueError(
            f"the sequence has {where.numel()} image positions but the images give {n_rows} feature rows"
        )
    if n_rows:
        feats = torch.cat([f.to(device=out.device, dtype=out.dtype) for f in features])
        out[where] = round_to(feats, act_dtype).to(out.dtype)
    return out

"""Prompt encoding and request checks shared by the single-process engine and the data-parallel front
(which answers them from its ranks' model facts, without a model of its own)."""

from __future__ import annotations

import random

from ..sampling_params import SamplingParams
from ..tokenizer import encode_prompt
from .request_checks import check_params, check_prompt


class PromptChecks:
    """Needs `tokenizer`, `bos_token_id`, `vocab_size` and `max_model_len` on the engine."""

    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, self.bos_token_id, prompt)

    def validate_prompt(self, prompt_token_ids: list[int], image_positions=None) -> list[int]:
        """The prompt's ids as Python ints; ValueError naming what is wrong. `image_positions`: a request
        with images, True per position of its image blocks (their sentinel ids are not checked)."""
        return check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len, image_positions)

    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, image_positions=None
    ) -> list[int]:
        """Every field of a request checked against this model (request_checks.py); the prompt's ids
        as Python ints."""
        ids = self.validate_prompt(prompt_token_ids, image_positions)
        check_params(params, self.vocab_size)
        return ids

    def request_ids(
        self, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams
    ) -> list[int]:
        """A text-only request's checked prompt ids: `prompt_token_ids`, else `prompt` encoded."""
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("either prompt or prompt_token_ids must be given")
            prompt_token_ids = self.encode(prompt)
        return self.validate_request(prompt_token_ids, params)

    def front_request(
        self, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams, multi_modal_data
    ) -> tuple[list[int], tuple | None]:
        """A front's view of a request (a data-parallel or disaggregated front, `images` its
        `ImagePreparer`): its prompt ids and its images. Text only: the checked ids and None. With images:
        read, preprocessed and checked here (`images.prepared_at_front`), the pair (`PreparedImages`, the
        prompt ids as given) that an engine expands; the ids are the text's (`<image>` or the placeholder
        ids standing for each image), what the front has of its prompt until then."""
        if multi_modal_data is None:
            return self.request_ids(prompt, prompt_token_ids, params), None
        from .images import prepared_at_front  # (torch and the vision path: only for images)

        images = (prepared_at_front(self.images, multi_modal_data), prompt_token_ids)
        if prompt_token_ids is not None:
            return list(prompt_token_ids), images
        if prompt is None:
            raise ValueError("either prompt or prompt_token_ids must be given")
        return self.encode(prompt), images


def engine_prompt(ids: list[int], images: tuple | None) -> tuple[list[int] | None, object | None]:
    """What an engine's `add_request` takes for a request a front sent (`PromptChecks.front_request`'s
    ids and images): (prompt_token_ids, multi_modal_data). Text only: the front's ids, no images. With
    images: the prompt ids as the caller gave them (the front's are the text's) and the prepared images,
    which the engine expands."""
    if images is None:
        return ids, None
    prepared, given = images
    return given, prepared


def front_seeds(rng: random.Random, params: SamplingParams) -> list[int] | None:
    """A front's seeds for a request's n samples, drawn from one stream in arrival order as one engine
    draws them (so sampled outputs do not depend on the layout); None when it carries seq_seed."""
    return None if params.seq_seed is not None else [rng.getrandbits(64) for _ in range(params.n)]

"""From the scheduler's output to the worker's `StepInput`: each emitting sequence's sampling row
(seed, position, filters, banned tokens), its teacher-forced token, its grammar mask.

The sampler's draw depends only on (seed, position), so a row built here is the same whichever loop
(sync, async, speculative) asks for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from deepinfer_model import RowParams

from . import scheduling
from .prompt_logprobs import PromptTargets, set_prompt_rows
from .request import SeqState
from .request_table import RequestTable
from .step_io import StepInput
from .truncation import Truncation


class StepBuilder:
    def __init__(
        self,
        table: RequestTable,
        truncation: Truncation,
        eos_token_id: int | None,
        blacklist: tuple[int, ...],
    ) -> None:
        self.table, self.truncation = table, truncation
        self.eos_token_id, self.blacklist = eos_token_id, blacklist
        # Grammar masks are filled here while the forward runs (xgrammar releases the GIL; the masks
        # are needed only at sampling), so their cost leaves the step's critical path.
        self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-masks")

    def step(self, out, fill_from_previous: bool = False) -> StepInput:
        """The step the scheduler planned. fill_from_previous: its unknown input ids are the tokens of
        the step launched just before it (the asynchronous loop; `prev_rows` say which)."""
        batch = scheduling.to_runner_batch(out, fill_from_previous)
        self.attach_images(batch)
        emits = scheduling.emits_tokens(out)
        rows: list[RowParams | None] = []
        golden: list[int | None] = []
        grammar_rows: dict[int, object] = {}
        for i, seq_id in enumerate(batch.seq_ids.tolist()):
            seq = self.table.seqs.get(seq_id)
            if not emits[i] or seq is None:
                rows.append(None)
                golden.append(None)
                continue
            position = int(batch.start_positions[i] + batch.query_lens[i])  # index of the token produced
            rows.append(self.row_params(seq, position))
            g = seq.request.params.golden_token_ids
            generated_before = position - len(seq.request.prompt_token_ids)
            golden.append(g[generated_before] if g is not None and generated_before < len(g) else None)
            if seq.grammar is not None:
                grammar_rows[i] = seq.grammar
        prompt_targets = self.prompt_rows(batch, scheduling.is_prefill(out))
        allowed = None
        if grammar_rows:  # a callable the worker resolves after the forward (filled meanwhile)
            allowed = self._mask_pool.submit(
                self.table.structured.allowed_rows, grammar_rows, len(rows)
            ).result
        return StepInput(
            batch,
            rows,
            golden,
            allowed,
            prev_rows=scheduling.prev_rows(out) if fill_from_previous else None,
            is_prompt=bool(scheduling.is_prefill(out).any()),
            prompt_targets=prompt_targets,
        )

    def prompt_rows(self, batch, prefill) -> dict[int, PromptTargets]:
        """The prefill chunks whose rows score prompt tokens (`SamplingParams.prompt_logprobs`, until
        every prompt position has its logprobs); their `logits_lens` become the chunk's length."""
        targets: dict[int, PromptTargets] = {}
        for i, seq_id in enumerate(batch.seq_ids.tolist()):
            seq = self.table.seqs.get(seq_id)
            if not prefill[i] or seq is None or not seq.request.wants_prompt_logprobs:
                continue
            prompt = seq.request.prompt_token_ids
            start, length = int(batch.start_positions[i]), int(batch.query_lens[i])
            scored = prompt[start + 1 : start + 1 + length]  # row j predicts the token at start + j + 1
            if scored:
                targets[i] = PromptTargets(start + 1, list(scored), seq.request.params.prompt_logprobs)
                set_prompt_rows(batch, i, targets[i])
        return targets

    def attach_images(self, batch) -> None:
        """Give the step the image embeddings of the image positions its prefill chunks compute."""
        feats, any_image = [], False
        for i, seq_id in enumerate(batch.seq_ids.tolist()):
            seq = self.table.seqs.get(seq_id)
            images = seq.request.images if seq is not None else None
            f = None
            if images is not None:
                start = int(batch.start_positions[i])
                f = images.step_features(start, start + int(batch.query_lens[i]))
            feats.append(f)
            any_image = any_image or f is not None
        if any_image:
            batch.image_features = feats

    def prefill_flops(self, out, batch) -> float:
        """Estimated FP8-equivalent FLOPs of the step's prefill chunks (statistics)."""
        return self.truncation.step_flops(batch, scheduling.is_prefill(out), self.table.prompt_len_of)

    def row_params(self, seq: SeqState, position: int, drafts: Sequence[int] = ()) -> RowParams:
        """How `seq` samples the token at `position`; `drafts`: tokens after the sequence's own, being
        verified (the rows after the first see them as output)."""
        p = seq.request.params
        prompt, output = self._seen(seq, position, drafts)
        return RowParams(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            seed=seq.seed,
            position=position,
            logprobs=p.logprobs,
            banned_token_ids=self._banned(seq, position - len(seq.request.prompt_token_ids)),
            allowed_token_ids=None if p.allowed_token_ids is None else tuple(p.allowed_token_ids),
            bad_words=seq.request.bad_words,
            logit_bias=tuple((p.logit_bias or {}).items()),
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            prompt_token_ids=prompt,
            output_token_ids=output,
        )

    @staticmethod
    def _seen(seq: SeqState, position: int, drafts: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The prompt and output tokens before `position`, for the rows whose processors read them
        (empty otherwise: the copy costs O(length) per row)."""
        req = seq.request
        if not req.reads_seen_tokens:
            return (), ()
        tokens = seq.token_ids + seq.committed_ahead + list(drafts)
        if position > len(tokens):
            # the asynchronous loop builds such rows only after the previous step is committed
            raise RuntimeError(
                f"sequence {seq.seq_id}: the tokens before position {position} are not known yet"
            )
        n = len(req.prompt_token_ids)
        output = tokens[n:position]
        prompt = req.prompt_tuple if req.params.repetition_penalty != 1.0 else ()
        return prompt, tuple(output)

    def _banned(self, seq: SeqState, generated_before: int) -> tuple[int, ...]:
        p = seq.request.params
        banned = list(self.blacklist)
        if generated_before < p.min_tokens or (p.first_n_token_no_eos == 1 and generated_before == 0):
            if self.eos_token_id is not None and not p.ignore_eos:
                banned.append(self.eos_token_id)
        if generated_before < p.min_tokens:
            banned.extend(p.stop_token_ids)
        return tuple(banned)

    def close(self) -> None:
        self._mask_pool.shutdown(wait=True)

"""The speculative loop (DSpark drafts; `spec_decode.py` has the protocol of one step).

It runs synchronously: a step's drafts come from the drafter after the previous step's verification
on the host, so there is nothing to overlap yet (a device-side draft path would change that). With
`async_scheduling` and the draft policy on, `spec_async_step.SpecAsyncStep` runs the steps in which
nobody drafts in the asynchronous loop and this one around drafts (same tokens by construction); without
the policy or with data parallelism every step runs here. A step in which no sequence verifies drafts
(the draft policy skipped them all) runs as the plain step.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from deepinfer_model import EMPTY_ROW_MESSAGE
from deepinfer_spec import MAX_NEXTN, StepTimeCurve

from .. import envs
from . import scheduling
from .drafting import Drafter, DraftRequest, ModelDrafter, PagedDrafter
from .spec_decode import SpecDecoder, VerifyInput
from .step_io import StepInput, StepResult, VerifyStepInput, VerifyStepResult
from .step_strategy import StepContext, StepStrategy

logger = logging.getLogger("deepinfer")


class SpecStep(StepStrategy):
    def __init__(self, ctx: StepContext, spec: SpecDecoder) -> None:
        super().__init__(ctx)
        self.spec = spec
        ctx.table.tracker = spec  # drafts live and die with their sequences
        self._drafts_agreed = False
        if ctx.dp is not None and ctx.dp.draft_collectives is not None and not spec.counts_draft_forwards:
            raise ValueError(
                "sharded draft experts (DEEPINFER_EP_SHARD_DRAFT_EXPERTS=1) need a drafter that states its "
                f"draft forwards in advance (the paged drafter), not {type(spec.drafter).__name__}; set "
                "DEEPINFER_EP_SHARD_DRAFT_EXPERTS=0 to hold every draft expert on every rank"
            )

    def step(self) -> None:
        self._drafts_agreed = False
        self._step()
        if self.dp is not None and not self._drafts_agreed:  # a step that drafted nothing still votes
            self.dp.agree_drafts(0)

    def _step(self) -> None:
        out, _ = self._schedule()
        for seq_id in scheduling.preempted(out):
            self.spec.discard(seq_id)
        self._vote(launching=0 if scheduling.is_empty(out) else 1)
        if scheduling.is_empty(out):
            self._idle(out)
            return
        stage, forward_ran = "kv tier", False
        try:
            out = self._transfer_sync(out)
            if out is None:
                return
            stage = "prepare"
            draft_s = self.spec.draft_s
            t0 = time.perf_counter()
            verified = bool(scheduling.num_draft_tokens(out).any())
            if not verified:
                # nobody verifies drafts: the plain step (verifying k = 0 drafts draws exactly its
                # tokens, at a higher cost), the drafter proposing after it as after a verification
                plain = self._build(out)
                batch, prepare_s = plain.batch, time.perf_counter() - t0
                self.stats.prepare_s += prepare_s
                stage, forward_ran = "model step", True
                plain_result = self.worker.run(plain)
                stage = "output processing"
                t0 = time.perf_counter()
                self._process_plain(out, plain, plain_result)
            else:
                step, confs = self._prepare(out)
                self.stats.prefill_flops += self.builder.prefill_flops(out, step.batch)
                batch, prepare_s = step.batch, time.perf_counter() - t0
                self.stats.prepare_s += prepare_s
                stage, forward_ran = "model step", True
                result = self.worker.run_verify(step, self.spec.verifier)
                stage = "output processing"
                t0 = time.perf_counter()
                self._process(out, step, confs, result)
            process_s = time.perf_counter() - t0
            self.stats.process_s += process_s
            if not scheduling.is_prefill(out).any():  # decode steps, as the step-time curve models them
                # the step's host work: all of prepare and output processing but the draft forward
                host_s = prepare_s + process_s - (self.spec.draft_s - draft_s)
                self.spec.record_host_time(int(batch.query_lens.sum()), host_s, verified)
            self.table.collect_all()
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine goes on
            self._recover(out, stage, e, forward_ran)

    def _process_plain(self, out, step: StepInput, result: StepResult) -> None:
        ids = step.batch.seq_ids.tolist()
        finished = self.output.commit(out, result)
        emitted = {
            i: (int(step.batch.start_positions[i] + step.batch.query_lens[i]), 0)
            for i, row in enumerate(step.rows)
            if row is not None and result.tokens[i] >= 0 and i not in result.errors
        }
        self.output.emit(out, result, finished)
        self.record_plain_step(out, result, list(emitted))
        self._propose_drafts(ids, emitted, finished)

    def record_plain_step(self, out, result: StepResult, emitted: list[int]) -> None:
        """A plain step's request-steps (`emitted`: the batch indices that emitted a token) and, for a
        decode step (the varlen rule's step-time curve models decode steps), its measured times."""
        prefill = scheduling.is_prefill(out)
        self.spec.record_plain(sum(1 for i in emitted if not prefill[i]))
        if not prefill.any():
            tokens = int(np.asarray(out.query_lens).sum())
            self.spec.update_runtime(
                tokens, result.forward_s, len(emitted), result.sample_s, len(emitted), False
            )
        else:
            self.spec.untimed_step()

    def _prepare(self, out) -> tuple[VerifyStepInput, list[list[float]]]:
        """Runner batch with 1 + k logits rows per verifying sequence, a VerifyInput per emitting
        sequence (None otherwise), grammar masks per packed row; and per sequence the confidences of
        the drafts it was fed."""
        batch = scheduling.to_verify_batch(out)
        self.builder.attach_images(batch)
        ks = scheduling.num_draft_tokens(out)
        inputs: list[VerifyInput | None] = []
        grammar_reqs, confs, packed = [], [], 0
        for i, seq_id in enumerate(batch.seq_ids.tolist()):
            n, k = int(batch.logits_lens[i]), int(ks[i])
            seq = self.table.seqs.get(seq_id)
            if n == 0 or seq is None:
                inputs.append(None)
                confs.append([])
                continue
            if n != 1 + k:
                raise RuntimeError(f"sequence {seq_id}: {n} logits rows for {k} drafts")
            drafts, probs, c = self.spec.pending(seq_id, k) if k else ([], None, [])
            first = int(batch.query_offsets[i]) + 1
            if drafts != batch.input_ids[first : first + k].tolist():
                raise RuntimeError(f"sequence {seq_id}: the scheduler fed other drafts than were proposed")
            base = int(batch.start_positions[i] + batch.query_lens[i]) - k  # row 0's token position
            prompt_len = len(seq.request.prompt_token_ids)
            g = seq.request.params.golden_token_ids
            golden = [
                g[base + j - prompt_len] if g is not None and base + j - prompt_len < len(g) else -1
                for j in range(1 + k)
            ]
            rows = [self.builder.row_params(seq, base + j, drafts) for j in range(1 + k)]
            inputs.append(VerifyInput(rows, drafts, probs, golden))
            confs.append(list(c))
            if seq.grammar is not None:
                grammar_reqs.append((seq.grammar, packed, drafts))
            packed += n
        structured = self.table.structured
        allowed = structured.allowed_rows_with_drafts(grammar_reqs, packed) if grammar_reqs else None
        prefill = scheduling.is_prefill(out)
        prompt_targets = self.builder.prompt_rows(batch, prefill)  # after the loop: it widens logits_lens
        return VerifyStepInput(batch, inputs, allowed, bool(prefill.any()), prompt_targets), confs

    def _process(
        self, out, step: VerifyStepInput, confs: list[list[float]], result: VerifyStepResult
    ) -> None:
        ids = step.batch.seq_ids.tolist()
        self.output.fail_errors(ids, result.errors)  # first: a failed request emits nothing below
        emitted: list[list[int]] = [[] for _ in ids]
        no_token: list[int] = []  # batch indices that reached a row allowing no token
        outcome = result.outcome
        if outcome is not None:
            for idx, i in enumerate(result.verified):
                seq = self.table.seqs.get(ids[i])
                if seq is None or seq.finished:
                    continue
                emitted[i] = self.output.stop_cut(seq, outcome.result.emitted[idx])
                if outcome.result.no_token[idx]:
                    # Its accepted drafts are what plain decoding emits before reaching that row; they may
                    # end the request (a stop token), else it fails after them as a plain row would.
                    if emitted[i]:
                        no_token.append(i)
                    else:
                        self.table.fail_seq(ids[i], f"sampling failed: {EMPTY_ROW_MESSAGE}")
        finished = self.output.commit_verified(out, emitted)
        emitted_at: dict[int, tuple[int, int]] = {}  # batch index -> (base position, drafts accepted)
        if outcome is not None:
            prefill = scheduling.is_prefill(out)
            # (the sequences of requests that failed this step have left the spec state)
            kept = [idx for idx, i in enumerate(result.verified) if ids[i] in self.table.seqs]
            verified = [result.verified[idx] for idx in kept]
            vids = [ids[i] for i in verified]
            decode = [not bool(prefill[i]) for i in verified]
            fed_confs = [c for i in verified for c in confs[i]]
            rollbacks = self.spec.commit(vids, outcome.result.select(kept), decode, fed_confs)
            # The runner forgets the rejected rows; the scheduler already did (num_computed_tokens).
            self.worker.rollback([(rb.seq_id, rb.num_discarded) for rb in rollbacks])
            for rb, i in zip(rollbacks, verified):
                emitted_at[i] = (step.inputs[i].base_position, rb.num_accepted)
                seq = self.table.seqs.get(ids[i])
                if seq is not None:
                    seq.request.metrics.num_draft_tokens += rb.num_verified
                    seq.request.metrics.num_accepted_draft_tokens += rb.num_accepted
        self.output.emit_verified(ids, emitted, result, finished)
        for i in no_token:
            seq = self.table.seqs.get(ids[i])
            if seq is not None and not seq.finished:
                self.table.fail_seq(ids[i], f"sampling failed: {EMPTY_ROW_MESSAGE}")
        decode_seqs = sum(1 for x in step.inputs if x is not None)
        if not scheduling.is_prefill(out).any():  # the varlen rule's step-time curve models decode steps
            rows = sum(int(step.batch.logits_lens[i]) for i in result.verified)
            tokens = int(step.batch.query_lens.sum())
            self.spec.update_runtime(tokens, result.forward_s, decode_seqs, result.sample_s, rows, True)
        else:
            self.spec.untimed_step()
        self._propose_drafts(ids, emitted_at, finished)

    def _propose_drafts(self, ids, emitted_at: dict[int, tuple[int, int]], finished) -> None:
        """The drafter proposes after every sequence that emitted (`emitted_at`: batch index -> the
        position of its first emitted token and the drafts it accepted) and goes on; the draft policy
        (MTP varlen), or all of them, decides who drafts and how many the scheduler feeds next step.
        The policy decides first: a sequence it skips costs no request (no copy of its context)."""
        candidates, going_on = self.draft_candidates(ids, emitted_at, finished)
        t0 = time.perf_counter()
        drafting = self.spec.choose_drafting([(seq.seq_id, k) for _, seq, k in candidates], going_on)
        requests = [
            self._draft_request(seq, k, *emitted_at[i]) for (i, seq, k), d in zip(candidates, drafting) if d
        ]
        for seq_id, drafts in self._draft(requests, going_on).items():
            if drafts:
                scheduling.set_draft_tokens(self.scheduler, seq_id, drafts)
        self.stats.draft_s += time.perf_counter() - t0

    def draft_candidates(self, ids, emitted, finished) -> tuple[list[tuple[int, object, int]], int]:
        """(batch index, sequence, drafts it may propose) of the sequences that emitted (`emitted`: their
        batch indices), go on and have room for a draft; and how many go on (the next step decodes them,
        with or without drafts)."""
        candidates, going_on = [], 0
        for i, seq_id in enumerate(ids):
            seq = self.table.seqs.get(seq_id)
            if i not in emitted or seq is None or seq.finished or seq_id in finished:
                continue
            going_on += 1
            k = self.drafts_that_fit(seq)
            if k >= 1:
                candidates.append((i, seq, k))
        return candidates, going_on

    def drafts_that_fit(self, seq, emitting: int = 0) -> int:
        """Drafts the sequence may propose after `emitting` more tokens: at most nextn, and one token fewer
        than it may still emit (the step emits one token beyond its drafts)."""
        p = seq.request.params
        room = min(p.max_tokens - seq.num_generated, self.output.max_model_len - len(seq.token_ids))
        return min(self.spec.nextn, room - emitting - 1)

    def _draft_request(self, seq, num_drafts: int, base_position: int, num_accepted: int) -> DraftRequest:
        params = self.builder.row_params(seq, len(seq.token_ids))
        return DraftRequest(
            seq_id=seq.seq_id,
            context=seq.token_ids[:-1],
            next_token=seq.token_ids[-1],
            num_drafts=num_drafts,
            params=params,
            base_position=base_position,
            num_accepted=num_accepted,
            draft_seed=self.spec.verifier.draft_seed(params.seed),
        )

    def _draft(self, requests: list[DraftRequest], num_seqs: int) -> dict[int, list[int]]:
        """`spec.propose` of the requests the draft policy lets draft; with sharded draft experts (data
        parallel) inside the step's draft vote: every EP rank runs the group's largest number of draft
        forwards, its own and idle ones."""
        if self.dp is None:
            return self.spec.propose(requests, num_seqs)
        planned = self.spec.draft_forwards(requests)
        self.dp.agree_drafts(planned)
        self._drafts_agreed = True
        target = self.dp.draft_forwards() + planned
        try:
            return self.spec.propose(requests, num_seqs)
        finally:
            self.dp.settle_drafts(target)


# ---------------------------------------------------------------------------- building the decoder
def resolve_nextn(requested: int | None, drafter: Drafter | None, model, is_default_model: bool) -> int:
    """Drafts per step: the caller's, else DEEPINFER_USE_NEXTN_DECODE; 0 where nothing can draft."""
    if requested is None and is_default_model and not envs.is_set("DEEPINFER_USE_NEXTN_DECODE"):
        # deepinfer-tiny's weights are random: its drafts are (almost) never accepted, so drafting
        # would only slow the demo down (measured 2.5x). Real checkpoints get the reference's 5.
        logger.info("deepinfer-tiny has random weights: speculative decoding off unless asked for")
        return 0
    nextn = int(envs.DEEPINFER_USE_NEXTN_DECODE) if requested is None else requested
    if isinstance(nextn, bool) or not 0 <= nextn <= MAX_NEXTN:
        raise ValueError(f"num_speculative_tokens must be in [0, {MAX_NEXTN}], got {nextn!r}")
    if nextn and drafter is None and getattr(getattr(model, "weights", None), "drafter", None) is None:
        # The env var is a process-wide default: models without draft blocks just decode plainly.
        log = logger.debug if requested is None else logger.warning
        log("speculative decoding off: the checkpoint has no DSpark draft blocks")
        return 0
    return nextn


def make_spec_decoder(
    nextn: int, drafter: Drafter | None, curve_given, model, runner, max_num_seqs: int
) -> SpecDecoder:
    """The engine's speculative-decoding state; the default drafter reads the paged runner's cached
    drafter keys where it can, else runs the model's draft blocks."""
    curve = _step_time_curve(curve_given, nextn, model, max_num_seqs)
    if drafter is None:
        paged = hasattr(runner, "last_step_index")
        drafter = PagedDrafter(runner, model) if paged else ModelDrafter(model)
    return SpecDecoder(nextn, drafter, curve)


def _step_time_curve(given, nextn: int, model, max_num_seqs: int) -> StepTimeCurve | None:
    """The varlen rule's step-time curve: given / loaded from a file / measured on the model now."""
    if not envs.DEEPINFER_ENABLE_MTP_VARLEN:
        return None
    if isinstance(given, StepTimeCurve):
        return given
    if given is not None:
        return StepTimeCurve.load(given)
    max_tokens = min(max_num_seqs * (1 + nextn), 64)
    sizes = sorted({1, 2, 4, 8, 16, 32, 64, max_tokens} & set(range(1, max_tokens + 1)))
    ids = torch.arange(max_tokens) % int(model.config.vocab_size)

    def step(n: int) -> None:  # one forward over n query tokens: the step's cost grows with them
        model.forward(ids[:n])

    logger.info("measuring the decode step-time curve for MTP varlen (%d sizes)", len(sizes))
    # beyond the measured sizes the line through the last two points prices larger batches
    return StepTimeCurve.measure(step, sizes, repeats=3, mode="linear", extrapolate=True)

"""The model side of one engine step: runner forward + sampling, isolated per request on failure.

Runs on the engine's worker thread under asynchronous scheduling (while the main thread schedules
the next step), or inline in the synchronous loop. It touches no scheduler or request state, so the
two threads share nothing but the immutable step description.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from deepinfer_model import EMPTY_ROW_MESSAGE, RowParams, Sampler, SamplerOutput, StepBatch, to_device
from deepinfer_spec import DraftVerifier

from .. import envs
from .device_timing import DeviceTimeline
from .prompt_logprobs import PendingPromptRows
from .spec_decode import verify_logits
from .step_io import StepInput, StepResult, VerifyStepInput, VerifyStepResult


@dataclass
class PendingStep:
    """A step whose forward and sampling are enqueued on the device and whose tokens are not read back
    yet (`ModelWorker.launch` -> `ModelWorker.finish`)."""

    rows: list[RowParams | None]
    golden: list[int | None]
    result: StepResult
    index: int  # the worker's launch count when this step was launched
    emitting: list[int] = field(default_factory=list)  # batch rows that sample a token
    picked: torch.Tensor | None = None  # their logits rows
    out: SamplerOutput | None = None
    device_tokens: torch.Tensor | None = None  # long [rows]: each row's sampled token on the device, or -1
    fed: np.ndarray | None = None  # bool [rows]: a next step may read the row's token in `device_tokens`
    readback: tuple | None = None  # CUDA: pinned host copies of the tokens and the empty-row flags
    prompt_rows: PendingPromptRows | None = None  # prompt logprobs reduced on the device
    done: torch.cuda.Event | None = None  # CUDA: recorded after the step's last work (copies included)
    t0: float = 0.0
    t1: float = 0.0
    # seconds the model thread sat waiting for its next job after launching it (the asynchronous loop
    # finishes a step when the next job arrives): not the step's time
    waited_s: float = 0.0

    def complete(self) -> bool:
        """Whether the device has finished the step (always, where the device is the host)."""
        return self.done is None or self.done.query()


class ModelWorker:
    def __init__(
        self,
        runner,
        sampler: Sampler | None = None,
        timeline: DeviceTimeline | None = None,
        collectives=None,
    ) -> None:
        """timeline: where each step's device start / end events go (device_timing.py; None: not timed);
        collectives: the model's expert-parallel MoE on a data-parallel rank (data_parallel.py's
        ExpertCollectives; None: single process): every forward must then join every MoE layer's
        all-to-all exactly once, so a failed forward is not retried sequence by sequence."""
        self.runner = runner
        self.sampler = sampler or Sampler()
        self.timeline = timeline
        self._cuda = torch.device(getattr(runner, "device", "cpu")).type == "cuda"
        self.collectives = collectives
        self._last_tokens: np.ndarray | None = None  # tokens of the step run last (per batch row)
        self._launched = 0  # steps launched so far (PendingStep.index)
        self.device_fed_steps = 0  # steps whose unknown inputs were read on the device (tests, stats)

    @property
    def feeds_device_inputs(self) -> bool:
        """Whether a step may take the previous step's tokens on the device (`launch(..., prev=)`): the
        runner takes `StepBatch.device_input_ids`, the process runs alone (a data-parallel rank's
        forwards pair with the other ranks' one for one) and DEEPINFER_ASYNC_DEVICE_INPUTS is on."""
        return (
            getattr(self.runner, "takes_device_input_ids", False)
            and self.collectives is None
            and envs.DEEPINFER_ASYNC_DEVICE_INPUTS
        )

    def run(self, step: StepInput) -> StepResult:
        """One step: `launch`, then `finish` (the synchronous loop, and tests)."""
        return self.finish(self.launch(step))

    def launch(self, step: StepInput, prev: PendingStep | None = None) -> PendingStep:
        """A step up to the read-back: the forward and the sampling are enqueued on the device, the tokens
        stay there (`finish` reads them).

        step.prev_rows[i]: sequence i's row in the step this worker ran last, whose sampled token fills
        its unknown (-1) input id — the asynchronous loop's correction of a step scheduled ahead;
        step.allowed, when a callable, is called after the forward (its mask fill ran beside it);
        prev: the step launched just before, not finished yet (only when `feeds_device_inputs`): the
        unknown input ids are then its sampled tokens, read on the device, and this step runs right
        behind it without waiting for the host."""
        batch, rows, golden, allowed, prev_rows = (
            step.batch,
            step.rows,
            step.golden,
            step.allowed,
            step.prev_rows,
        )
        self._launched += 1  # (first: a step that fails to launch still outdates the tokens kept)
        if prev_rows is not None:
            if prev is not None:
                self._feed_from_device(batch, prev_rows, prev)
            else:
                self._fill_unknown_inputs(batch, prev_rows)
        self._last_tokens = None  # never let a later step read tokens of a step before this one
        n = len(rows)
        result = StepResult(
            tokens=np.full(n, -1, dtype=np.int64), logprobs=[None] * n, top=[None] * n, ranks=[None] * n
        )
        pending = PendingStep(rows=rows, golden=golden, result=result, index=self._launched)
        pending.t0 = time.perf_counter()
        self._timing_begin()
        logits, ok = self._forward(batch, result, step.is_prompt)
        pending.t1 = time.perf_counter()
        if callable(allowed):
            allowed = allowed()
        emitting = [i for i in ok if rows[i] is not None]
        # logits rows follow the batch order of sequences with logits_lens > 0: a sequence's rows end
        # with the one it samples from (before it: the prompt rows whose logprobs were asked)
        first_row = _first_rows(batch, ok)
        pending.prompt_rows = _prompt_rows(logits, first_row, step.prompt_targets)
        if emitting:
            row_of = {i: first_row[i] + int(batch.logits_lens[i]) - 1 for i in emitting}
            # a gathered copy, so the sampler may mask it in place (the runner's logits may be inference
            # tensors); the index reaches the device without waiting for it
            take = to_device(np.asarray([row_of[i] for i in emitting], dtype=np.int64), logits.device)
            picked = logits[take]
            # packed masks by batch row -> by picked row (rows of failed sequences dropped)
            mask = allowed.remap({i: k for k, i in enumerate(emitting)}) if allowed is not None else None
            try:
                # (the sampler keeps `picked` unmasked when logprobs are asked)
                out = self.sampler(
                    picked,
                    [rows[i] for i in emitting],
                    allowed=mask,
                    overwrite_logits=True,
                    defer_checks=True,
                )
            except ValueError as e:
                for i in emitting:
                    result.errors[i] = f"sampling failed: {e}"
                emitting, out = [], None
            pending.emitting, pending.picked, pending.out = emitting, picked, out
            if emitting:
                pending.device_tokens, pending.fed = self._device_tokens(n, emitting, golden, out, logits)
                pending.readback = _start_readback(out)
        self._timing_end(batch)  # sampling enqueued (prefill chunks: after the forward); nothing waited
        if self._cuda:
            pending.done = torch.cuda.Event()
            pending.done.record()
        return pending

    def finish(self, pending: PendingStep) -> StepResult:
        """The step's tokens, log-probabilities and errors (reads the sampled ids back: one copy)."""
        result, rows, golden = pending.result, pending.rows, pending.golden
        if pending.emitting:
            out = pending.out
            sampled, empty = _read_back(out, pending)
            for k, i in enumerate(pending.emitting):
                if empty is not None and empty[k]:
                    result.errors[i] = f"sampling failed: {EMPTY_ROW_MESSAGE}"
                    continue
                token = sampled[k]
                if golden[i] is not None:  # teacher forcing: emit the given token, report its logprob
                    token = golden[i]
                result.tokens[i] = token
                if rows[i].logprobs is not None:
                    lp = torch.log_softmax(pending.picked[k].float(), dim=-1)
                    chosen = lp[token]
                    # one copy for both: the count is exact in float32 (vocabularies < 2**24)
                    value, above = torch.stack((chosen, (lp > chosen).sum().to(lp.dtype))).tolist()
                    result.logprobs[i], result.ranks[i] = value, int(above) + 1
                    if rows[i].logprobs > 0:
                        top = out.top_token_ids[k, : rows[i].logprobs].tolist()
                        vals = out.top_logprobs[k, : rows[i].logprobs].tolist()
                        result.top[i] = dict(zip(top, vals))
        if pending.prompt_rows is not None:
            result.prompt_rows = pending.prompt_rows.read()
        result.forward_s = pending.t1 - pending.t0
        result.sample_s = time.perf_counter() - pending.t1 - pending.waited_s
        if pending.index == self._launched:  # (a step launched after this one owns the next fill)
            self._last_tokens = result.tokens
        return result

    def run_verify(self, step: VerifyStepInput, verifier: DraftVerifier) -> VerifyStepResult:
        """A step whose decode rows may verify drafts (step.batch.logits_lens = 1 + k for them)."""
        batch, inputs, allowed = step.batch, step.inputs, step.allowed
        result = VerifyStepResult(verified=[], outcome=None)
        t0 = time.perf_counter()
        self._timing_begin()
        logits, ok = self._forward(batch, result, step.is_prompt)
        t1 = time.perf_counter()
        okset = set(ok)
        picked, kept_of = [], {}  # kept_of: packed row -> row among the verified sequences' rows
        offset = packed = kept = 0  # row in logits / in all emitting inputs / in the verified ones
        for i, inp in enumerate(inputs):
            n = int(batch.logits_lens[i])
            m = len(inp.rows) if inp is not None else 0  # its verify rows: the last m of its n
            if inp is not None and i in okset:
                picked.append(logits[offset + n - m : offset + n])
                result.verified.append(i)
                kept_of.update((packed + j, kept + j) for j in range(m))
                kept += m
            packed += m
            offset += n if i in okset else 0
        prompt_rows = _prompt_rows(logits, _first_rows(batch, ok), step.prompt_targets)
        mask = allowed.remap(kept_of) if allowed is not None else None
        if result.verified:
            try:
                result.outcome = verify_logits(
                    verifier,
                    torch.cat(picked),
                    [inputs[i] for i in result.verified],
                    mask,
                    overwrite_logits=True,
                )
            except ValueError as e:
                for i in result.verified:
                    result.errors[i] = f"sampling failed: {e}"
                result.verified, result.outcome = [], None
        if prompt_rows is not None:
            result.prompt_rows = prompt_rows.read()
        self._timing_end(batch)  # after verification (which copies its results to the host)
        result.forward_s, result.sample_s = t1 - t0, time.perf_counter() - t1
        return result

    def _forward(self, batch: StepBatch, result, is_prompt: bool = False) -> tuple[torch.Tensor, list[int]]:
        """Logits of the batch and the indices of the sequences they cover (all, unless it failed)."""
        if self.collectives is None:
            try:
                return self.runner.execute(batch), list(range(len(batch.seq_ids)))
            except Exception:  # noqa: BLE001 - find the sequence(s) at fault; the others go on
                return self._execute_one_by_one(batch, result)
        self.collectives.begin(is_prompt)
        try:
            logits, ok = self.runner.execute(batch), list(range(len(batch.seq_ids)))
        except Exception as e:  # noqa: BLE001 - the rank's batch fails, the world goes on
            # Re-running sequence by sequence would be forwards the other ranks do not join.
            for i in range(len(batch.seq_ids)):
                result.errors[i] = f"model forward failed: {type(e).__name__}: {e}"
            vocab = self.runner.vocab_size
            logits, ok = torch.empty(0, vocab, device=getattr(self.runner, "device", "cpu")), []
        self.collectives.finish()  # the MoE layers a failed (or empty) forward did not reach; EPLB step
        return logits, ok

    def idle(self) -> None:
        """A data-parallel rank with nothing scheduled: every MoE layer's all-to-all, without tokens."""
        self.collectives.idle()

    def rollback(self, rejected: list[tuple[int, int]]) -> None:
        """Tell the runner which sequences had (seq_id, n) trailing draft rows rejected (see
        spec_decode.py for the contract); runners without state to undo have no `rollback`."""
        fn = getattr(self.runner, "rollback", None)
        if fn is None:
            return
        for seq_id, n in rejected:
            if n > 0:
                fn(seq_id, n)

    def _timing_begin(self) -> None:
        if self.timeline is not None:
            self.timeline.begin()

    def _timing_end(self, batch: StepBatch) -> None:
        if self.timeline is not None:
            # decode: no prefill chunk in the step (every query token produces logits)
            decode = len(batch.query_lens) > 0 and bool(np.array_equal(batch.query_lens, batch.logits_lens))
            self.timeline.end(decode)

    def _device_tokens(
        self, n: int, emitting: list[int], golden: list[int | None], out: SamplerOutput, logits: torch.Tensor
    ) -> tuple[torch.Tensor, np.ndarray]:
        """(long [n] on the device: row i's sampled token, -1 where none; bool [n]: the rows a next step
        may read there, i.e. the sampled ones that teacher forcing does not override)."""
        fed = np.zeros(n, dtype=bool)
        fed[emitting] = True
        forced = [i for i in emitting if golden[i] is not None]
        fed[forced] = False  # (their next input is the given token, known on the host)
        if emitting == list(range(n)):
            return out.token_ids, fed
        tokens = torch.full((n,), -1, dtype=torch.int64, device=logits.device)
        tokens[to_device(np.asarray(emitting, dtype=np.int64), logits.device)] = out.token_ids
        return tokens, fed

    def _feed_from_device(self, batch: StepBatch, prev_rows: np.ndarray, prev: PendingStep) -> None:
        """`_fill_unknown_inputs` from a step not finished yet: a given (teacher-forced) token is written
        on the host, a sampled one is read on the device (`StepBatch.device_input_ids`). An input whose
        sequence emitted nothing in `prev` (it failed) stays -1: the runner rejects that sequence alone."""
        unknown = np.flatnonzero(batch.input_ids < 0)
        if len(unknown) == 0:
            return
        owner = np.searchsorted(batch.query_offsets, unknown, side="right") - 1
        rows = prev_rows[owner]
        ok = rows >= 0
        src = np.where(ok, rows, 0)
        given = np.array([-1 if g is None else g for g in prev.golden], dtype=np.int64)
        emitted = np.zeros(len(prev.rows), dtype=bool)
        emitted[prev.emitting] = True
        forced = ok & emitted[src] & (given[src] >= 0)
        batch.input_ids[unknown[forced]] = given[src[forced]]
        on_device = ok & prev.fed[src] if prev.fed is not None else np.zeros(len(unknown), dtype=bool)
        if on_device.any():
            tokens = prev.device_tokens
            ids = tokens[to_device(src[on_device].astype(np.int64), tokens.device)]
            batch.device_input_ids = (unknown[on_device], ids)
            self.device_fed_steps += 1

    def _fill_unknown_inputs(self, batch: StepBatch, prev_rows: np.ndarray) -> None:
        unknown = np.flatnonzero(batch.input_ids < 0)
        if len(unknown) == 0:
            return
        # the sequence owning each unknown token: the last one whose query starts at or before it
        owner = np.searchsorted(batch.query_offsets, unknown, side="right") - 1
        rows = prev_rows[owner]
        last = self._last_tokens
        ok = rows >= 0
        batch.input_ids[unknown[ok]] = last[rows[ok]] if last is not None else -1
        # anything still unknown (its sequence failed last step) stays -1: the runner rejects that
        # sequence alone, and its request has already been failed by the engine

    def _execute_one_by_one(self, batch: StepBatch, result: StepResult) -> tuple[torch.Tensor, list[int]]:
        rows, ok = [], []
        for i in range(len(batch.seq_ids)):
            try:
                rows.append(self.runner.execute(batch.one(i)))
                ok.append(i)
            except Exception as e:  # noqa: BLE001
                result.errors[i] = f"model forward failed: {type(e).__name__}: {e}"
        vocab = self.runner.vocab_size
        return (
            torch.cat(rows) if rows else torch.empty(0, vocab, device=getattr(self.runner, "device", "cpu"))
        ), ok


def _start_readback(out: SamplerOutput) -> tuple | None:
    """On CUDA: the sampled ids (and empty-row flags) copied into pinned host memory behind the sampling;
    None elsewhere (there the device is the host)."""
    if out.token_ids.device.type != "cuda":
        return None
    copies = []
    for t in (out.token_ids, out.empty_rows):
        host = None
        if t is not None:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
        copies.append(host)
    return tuple(copies)


def _read_back(out: SamplerOutput, pending: PendingStep) -> tuple[list[int], list[bool] | None]:
    """(sampled ids, empty-row flags or None) as host lists. On CUDA it waits on the step's event, which
    releases the interpreter lock while the device finishes, so the engine's thread commits and
    schedules meanwhile, then reads the pinned copies."""
    if pending.readback is None:
        empty = out.empty_rows.tolist() if out.empty_rows is not None else None
        return out.token_ids.tolist(), empty
    pending.done.synchronize()
    tokens, empty = pending.readback
    return tokens.tolist(), None if empty is None else empty.tolist()


def _first_rows(batch: StepBatch, ok: list[int]) -> dict[int, int]:
    """Each computed sequence's first row in the step's logits."""
    first, at = {}, 0
    for j in ok:
        first[j] = at
        at += int(batch.logits_lens[j])
    return first


def _prompt_rows(logits: torch.Tensor, first_row: dict[int, int], targets: dict) -> PendingPromptRows | None:
    spans = [(i, first_row[i], t) for i, t in targets.items() if i in first_row]
    return PendingPromptRows(logits, spans) if spans else None

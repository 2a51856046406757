"""Output processing: a step's tokens committed to the scheduler and the grammars, then emitted into
the requests (text, stop strings, logprobs) that `step()` returns once finished.

Commit and emit are separate because the asynchronous loop launches the next step between them: the
scheduler and the grammar states must know step N's tokens before N+1's masks are built, while
detokenizing N can wait until N+1 runs.

A failure while committing or emitting one sequence (a grammar that refuses its token, the detokenizer)
fails that sequence's request alone; a commit the scheduler refuses fails the step's requests and closes
the step with no tokens, so the scheduler never keeps an unprocessed step behind.
"""

from __future__ import annotations

from . import scheduling
from .request import SeqState
from .request_table import RequestTable
from .spec_decode import VerifyOutcome
from .stats import EngineStats
from .step_io import StepResult, VerifyStepResult

# The scheduler's finish reasons as the user sees them; a preempted sequence that is not recomputed
# (EngineArgs.stop_preempted_request) gets the reference's name for it.
_REASONS = {
    "stop": "stop",
    "length": "length",
    "max_model_len": "length",
    "abort": "abort",
    "preempted": "insufficient_system_resource",
    "prefilled": "prefilled",  # a PROMPT engine's request, handed off for decoding
}


class OutputProcessor:
    def __init__(self, table: RequestTable, stats: EngineStats, max_model_len: int) -> None:
        self.table, self.stats = table, stats
        self.scheduler = table.scheduler
        self.eos_token_id, self.max_model_len = table.eos_token_id, max_model_len
        # A PROMPT engine (pd_roles.py): its prefills commit no token (they finish "prefilled"), and
        # `on_finished` sees the scheduler's finish reasons right after each update.
        self.prompt_only = False
        self.on_finished = None

    # ---------------------------------------------------------------- one token per sequence
    def commit(self, out, result: StepResult, preempted: set[int] = frozenset()) -> dict[int, str]:
        """Tell the scheduler what the step produced; returns {seq_id: scheduler finish reason}.

        Grammar states advance here (not in `emit`) because the next step's masks are built from
        them before `emit` runs under asynchronous scheduling.
        """
        ids = scheduling.seq_ids(out).tolist()
        self.fail_errors(ids, result.errors)
        tokens = result.tokens.copy()
        tokens[list(result.errors)] = -1
        if self.prompt_only:
            tokens[:] = -1
        try:
            finished = scheduling.update_from_output(self.scheduler, out, tokens)
        except Exception as e:  # noqa: BLE001 - the scheduler checks a commit before applying any of it
            message = f"update failed: {type(e).__name__}: {e}"
            result.errors.update(dict.fromkeys(range(len(ids)), message))
            self.fail_errors(ids, result.errors)
            tokens[:] = -1
            finished = scheduling.update_from_output(self.scheduler, out, tokens)
        if self.on_finished is not None:
            self.on_finished(finished)
        self.table.release_pending()
        for i, seq_id in enumerate(ids):
            seq = self.table.seqs.get(seq_id)
            if seq is not None and seq.request.reads_seen_tokens and tokens[i] >= 0:
                seq.committed_ahead = [
                    int(tokens[i])
                ]  # (a token the scheduler then drops is cut by position)
        structured = self.table.structured
        if structured is not None:
            for i, seq_id in enumerate(ids):
                seq = self.table.seqs.get(seq_id)
                token = int(tokens[i])
                if seq is None or seq.grammar is None or seq.finished or token < 0:
                    continue
                if seq_id in preempted and seq.grammar.num_tokens >= self._committed(seq_id):
                    continue  # dropped by the scheduler; the recompute produces it again
                try:
                    structured.accept(seq.grammar, token)
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    result.errors[i] = f"structured output: {_describe(e)}"
                    self.table.fail(seq.request.request_id, result.errors[i])
        return finished

    def emit(
        self, out, result: StepResult, finished: dict[int, str], preempted: set[int] = frozenset()
    ) -> None:
        self._record_prompt_rows(scheduling.seq_ids(out).tolist(), result)
        for i, seq_id in enumerate(scheduling.seq_ids(out).tolist()):
            token = -1 if self.prompt_only else int(result.tokens[i])
            seq = self.table.seqs.get(seq_id)
            if seq is not None:
                seq.committed_ahead = []
            if seq is None or seq.finished or token < 0 or i in result.errors:
                continue
            if seq_id in preempted and seq.num_generated >= self._committed(seq_id):
                continue  # the scheduler dropped this token; recompute will produce it again
            try:
                seq.append(
                    token,
                    self.eos_token_id,
                    self.max_model_len,
                    result.logprobs[i],
                    result.top[i],
                    result.ranks[i],
                )
                self.stats.generated_tokens += 1
                self._settle(seq, finished)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self.table.fail_seq(seq_id, f"output processing failed: {_describe(e)}")
        self.settle_finished(finished)
        self._count_step(result)

    # ---------------------------------------------------------------- verified drafts
    def commit_verified(self, out, emitted: list[list[int]]) -> dict[int, str]:
        """emitted: per scheduled sequence, its accepted drafts then its final token ([] for none)."""
        finished = scheduling.update_from_lists(self.scheduler, out, emitted)
        self.table.release_pending()
        return finished

    def emit_verified(
        self, ids: list[int], emitted: list[list[int]], result: VerifyStepResult, finished: dict[int, str]
    ) -> None:
        self._record_prompt_rows(ids, result)
        outcome: VerifyOutcome | None = result.outcome
        where = {i: idx for idx, i in enumerate(result.verified)}
        structured = self.table.structured
        for i, seq_id in enumerate(ids):
            seq = self.table.seqs.get(seq_id)
            tokens = emitted[i]
            if seq is None or seq.finished or not tokens:
                continue
            if seq.grammar is not None and structured is not None:
                try:
                    structured.accept_many(seq.grammar, tokens)
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    self.table.fail(seq.request.request_id, f"structured output: {_describe(e)}")
                    continue
            idx = where[i]
            lps, tops, ranks = outcome.logprobs[idx], outcome.top[idx], outcome.ranks[idx]
            try:
                for j, token in enumerate(tokens):
                    seq.append(
                        token,
                        self.eos_token_id,
                        self.max_model_len,
                        None if lps is None else lps[j],
                        None if tops is None else tops[j],
                        None if ranks is None else ranks[j],
                    )
                    self.stats.generated_tokens += 1
                    if seq.finished:
                        break
                self._settle(seq, finished)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self.table.fail_seq(seq_id, f"output processing failed: {_describe(e)}")
        self.settle_finished(finished)
        self._count_step(result)

    def stop_cut(self, seq: SeqState, tokens: list[int]) -> list[int]:
        """Tokens after a stop token are never emitted (the scheduler would drop them too)."""
        p = seq.request.params
        for j, t in enumerate(tokens):
            if (t == self.eos_token_id and not p.ignore_eos) or t in p.stop_token_ids:
                return tokens[: j + 1]
        return tokens

    # ---------------------------------------------------------------- shared
    def _record_prompt_rows(self, ids: list[int], result: StepResult | VerifyStepResult) -> None:
        for i, rows in result.prompt_rows.items():
            seq = self.table.seqs.get(ids[i])
            if seq is not None and i not in result.errors:
                seq.request.add_prompt_rows(rows, seq.detok.decode_one)

    def fail_errors(self, ids: list[int], errors: dict[int, str]) -> None:
        """The requests of the sequences (batch indices) whose forward or sampling failed fail alone."""
        for i, message in errors.items():
            self.table.fail_seq(ids[i], message)

    def settle_finished(self, finished: dict[int, str]) -> None:
        """Sequences the scheduler finished outside a step's rows: preempted ones it does not recompute
        (absent from the step, or their token of the step in flight dropped) end with what they have."""
        for seq_id, reason in finished.items():
            seq = self.table.seqs.get(seq_id)
            if seq is not None and not seq.finished:
                seq.finish(_REASONS.get(reason, reason))

    def _settle(self, seq: SeqState, finished: dict[int, str]) -> None:
        """Make the engine and the scheduler agree on whether `seq` has ended."""
        if seq.finished:
            if seq.seq_id not in finished:  # ended here by a stop string / token: the scheduler may not know
                scheduling.abort(self.scheduler, seq.seq_id)
        elif seq.seq_id in finished:
            reason = finished[seq.seq_id]
            seq.finish(_REASONS.get(reason, reason))

    def _committed(self, seq_id: int) -> int:
        return scheduling.num_output_tokens(self.scheduler, seq_id)

    def _count_step(self, result: StepResult | VerifyStepResult) -> None:
        self.stats.steps += 1
        self.stats.forward_s += result.forward_s
        self.stats.sample_s += result.sample_s


def _describe(e: Exception) -> str:
    """A user's mistake (ValueError) reads as its message; anything else names its type too."""
    return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"

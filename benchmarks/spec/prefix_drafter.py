"""A drafter of controlled acceptance for the speculative-decoding benchmarks (no forward: proposing costs a
lookup per request): it proposes the drafts-off engine's continuation of each sequence with every draft
after the first `accepted` changed to another id. Under greedy decoding `accepted` drafts are accepted per
drafted step (fewer near max_tokens). Greedy only: its drafts carry no distribution q, and a sampled draft
without one is verified as drawn from a point mass, which accepts other drafts than the drafts-off draw."""

from __future__ import annotations

from deepinfer.engine.drafting import Drafts


def record_full(llm, prompts, params) -> list[list[int]]:
    """Prompt + output of each request, decoded by `llm` (an engine with drafts off)."""
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


class PrefixDrafter:
    """Drafts from known full sequences (prompt + drafts-off output): the first `accepted` right, the others
    another id. Proposing costs a lookup per request, no forward."""

    def __init__(self, full: list[list[int]], accepted: int, vocab_size: int) -> None:
        self.by_prompt_start = {}
        for seq in full:
            self.by_prompt_start.setdefault(tuple(seq[:4]), []).append(seq)
        self.accepted, self.vocab_size = accepted, vocab_size

    def propose(self, requests):
        out = []
        for req in requests:
            seen = [*req.context, req.next_token]
            full = next(f for f in self.by_prompt_start[tuple(seen[:4])] if f[: len(seen)] == seen)
            tokens = full[len(seen) : len(seen) + req.num_drafts]
            tokens += [0] * (req.num_drafts - len(tokens))
            tokens = [t if j < self.accepted else (t + 1) % self.vocab_size for j, t in enumerate(tokens)]
            out.append(Drafts(tokens, [0.9] * len(tokens)))
        return out

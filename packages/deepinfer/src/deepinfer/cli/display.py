"""What `deepinfer generate` prints without --output: each completion under a header naming the request
(the user's id, else its position) and its prompt, with the logprobs that were asked for."""

from __future__ import annotations

from .input_file import InputRequest

PROMPT_CHARS = 60  # of the prompt shown in a header


def prompt_summary(req: InputRequest) -> str:
    record = req.record
    if "messages" in record:
        last = record["messages"][-1]
        content = last.get("content") if isinstance(last, dict) else None
        text = content if isinstance(content, str) else ""
        return f"{len(record['messages'])} message(s), last {last.get('role')!r}: {_clip(text)}"
    if "prompt" in record:
        return _clip(record["prompt"])
    return f"{len(record['prompt_token_ids'])} prompt token ids"


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= PROMPT_CHARS else text[: PROMPT_CHARS - 3] + "...")


def completion_lines(req: InputRequest, out, decode) -> list[str]:
    """Lines for one finished request; `decode(token_id) -> str` names the tokens of logprobs."""
    who = f"id {req.user_id!r}" if req.has_id else f"#{req.index}"
    lines = [f"=== {who}: {prompt_summary(req)}"]
    for c in out.outputs:
        if len(out.outputs) > 1:
            lines.append(f"--- sample {c.index}")
        lines.append(c.text)
        if c.logprobs is not None:
            lines.append(f"--- logprobs (finish: {c.finish_reason})")
            lines += logprob_lines(c, decode)
    return lines


def logprob_lines(completion, decode) -> list[str]:
    """One line per generated token: the token, its logprob and rank in the vocabulary, then the top
    alternatives (the `Logprob` entries ranked 1..num_logprobs), most likely first."""
    k = completion.num_logprobs or 0
    lines = []
    for tid, entry in zip(completion.token_ids, completion.logprobs):
        chosen = entry[tid]
        line = f"  {_text(tid, chosen, decode)!r} {chosen.logprob:.4f}"
        if chosen.rank is not None:
            line += f" (rank {chosen.rank})"
        alts = sorted(
            ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k),
            key=lambda item: item[1].rank,
        )
        if alts:
            line += "  top: " + ", ".join(f"{_text(t, lp, decode)!r} {lp.logprob:.4f}" for t, lp in alts)
        lines.append(line)
    return lines


def _text(token_id: int, logprob, decode) -> str:
    """The token's text as the engine decoded it, else as `decode` gives it."""
    return logprob.decoded_token if logprob.decoded_token is not None else decode(int(token_id))

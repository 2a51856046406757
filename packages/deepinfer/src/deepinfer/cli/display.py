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
    """One line per generated token: the token, its logprob, then the top alternatives."""
    top = completion.top_logprobs or [None] * len(completion.token_ids)
    lines = []
    for tid, lp, alts in zip(completion.token_ids, completion.logprobs, top):
        line = f"  {decode(tid)!r} {lp:.4f}"
        if alts:
            line += "  top: " + ", ".join(f"{decode(int(t))!r} {v:.4f}" for t, v in alts.items())
        lines.append(line)
    return lines

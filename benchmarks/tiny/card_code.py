"""Section 3: do greedy completions of held-out Python function headers parse?

Prompts: top-level functions (a `def` at column 0 with a docstring and at least one more statement) of
held-out Python files, cut after the docstring's closing quotes (no newline: the model writes the line
break and the indentation itself, as the tokenizer merged them in training). The files are the
manifest's held-out `stdlib` / `site` files that exist on this machine with the recorded sha256; where
none do (the data was built on another machine), the held-out token stream's documents are decoded and
those that parse as Python are used. At most `PER_FILE` prompts per file, files in manifest order.

Each prompt, `BOS` first (as every training document starts), is completed greedily through
`deepinfer.LLM` with drafts off (greedy verification emits the same tokens), up to `max_tokens` tokens.
The completion is cut before its first line that starts at column 0 (the function has ended there).
Reported shares of prompts:

* `parse_rate`: `ast.parse(prompt + completion)` succeeds;
* `parse_with_body_rate`: it parses and the function gained at least one statement after its docstring
  (a docstring-only function parses too: this excludes completions that add nothing);
* `ended_rate`: the completion returned to column 0 within `max_tokens` (the function was finished).
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from pathlib import Path

import numpy as np
from card_common import Records
from deepinfer_tiny.recipe.data import BOS_ID, EOS_ID

PER_FILE = 2
MAX_PROMPT_CHARS = 1500
_COLUMN0 = re.compile(r"\n(?=\S)")


def function_prompts(source: str) -> list[str]:
    """Prompts of `source`: top-level documented functions, from the first decorator / `def` line to the
    docstring's closing quotes."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or len(node.body) < 2:
            continue
        doc = node.body[0]
        if not (
            isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        text = (
            "".join(lines[first - 1 : doc.end_lineno - 1]) + lines[doc.end_lineno - 1][: doc.end_col_offset]
        )
        if len(text) <= MAX_PROMPT_CHARS and lines[doc.end_lineno - 1][doc.end_col_offset :].strip() == "":
            out.append(text)
    return out


def _manifest_sources(data: Path):
    manifest = json.loads((data / "manifest.json").read_text())
    for name in ("stdlib", "site"):
        for path, _size, sha, split, _group in manifest["sources"].get(name, {}).get("files", []):
            if split != "heldout":
                continue
            try:
                raw = Path(path).read_bytes()
            except OSError:
                continue
            if hashlib.sha256(raw).hexdigest() == sha:
                yield raw.decode("utf-8", errors="replace")


def _stream_sources(data: Path, tokenizer_file: Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    held = np.asarray(np.load(data / "heldout.npy", mmap_mode="r"))
    starts = np.flatnonzero(held == BOS_ID)
    for lo, hi in zip(starts, list(starts[1:]) + [held.size]):
        ids = held[lo + 1 : hi].tolist()
        if ids and ids[-1] == EOS_ID:
            ids = ids[:-1]
        yield tok.decode(ids, skip_special_tokens=False)


def collect_prompts(data: Path, tokenizer_file: Path, count: int) -> tuple[list[str], str]:
    """Up to `count` prompts and where they came from (`manifest_files` or `heldout_stream`)."""
    for label, sources in (
        ("manifest_files", _manifest_sources(data)),
        ("heldout_stream", _stream_sources(data, tokenizer_file)),
    ):
        prompts: list[str] = []
        for source in sources:
            prompts += function_prompts(source)[:PER_FILE]
            if len(prompts) >= count:
                return prompts[:count], label
        if prompts:
            return prompts, label
    return [], "none"


def encode_prompts(prompts: list[str], tokenizer_file: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    return [[BOS_ID, *tok.encode(p, add_special_tokens=False).ids] for p in prompts]


def judge(prompt: str, completion: str) -> dict:
    """The completion cut at its first column-0 line, and whether prompt + it parses (with a body)."""
    m = _COLUMN0.search(completion)
    cut = completion[: m.start() + 1] if m else completion
    try:
        tree = ast.parse(prompt + cut)
    except (SyntaxError, ValueError):
        return {"ended": m is not None, "parses": False, "with_body": False, "completion": cut}
    fn = tree.body[0]
    return {"ended": m is not None, "parses": True, "with_body": len(fn.body) >= 2, "completion": cut}


def complete(model: Path, prompt_ids: list[list[int]], max_tokens: int, device, max_len: int) -> list[str]:
    from deepinfer import LLM, SamplingParams
    from deepinfer.reproducibility import nextn_decode

    with nextn_decode(0):
        llm = LLM(model=str(model), device=device, max_model_len=max_len)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        outs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=params)
    finally:
        llm.close()
    for o in outs:
        if o.error is not None:
            raise RuntimeError(f"code completion request {o.request_id} failed: {o.error}")
    return [o.outputs[0].text for o in outs]


def prompt_ids(model: Path, data: Path, count: int) -> list[list[int]]:
    """The token ids of up to `count` prompts (section 5 drafts on them when section 3 did not run)."""
    tokenizer_file = model / "tokenizer.json"
    return encode_prompts(collect_prompts(data, tokenizer_file, count)[0], tokenizer_file)


def run(
    models: dict[str, Path], data: Path, records: Records, counts: dict, device, out: Path
) -> list[list[int]]:
    """Fill the section's records (one per model); returns the prompts' token ids (section 5 drafts on them)."""
    first = next(iter(models.values()))
    tokenizer_file = first / "tokenizer.json"
    prompts, source = collect_prompts(data, tokenizer_file, counts["code_prompts"])
    if not prompts:
        records.skipped["code"] = "no held-out Python function with a docstring found"
        return []
    ids = encode_prompts(prompts, tokenizer_file)
    max_len = max(map(len, ids)) + counts["code_tokens"] + 1
    samples = []
    for variant, path in models.items():
        completions = complete(path, ids, counts["code_tokens"], device, max_len)
        judged = [judge(p, c) for p, c in zip(prompts, completions)]
        n = len(judged)
        records.add(
            "code",
            variant=variant,
            prompt_source=source,
            prompts=n,
            max_new_tokens=counts["code_tokens"],
            parse_rate=sum(j["parses"] for j in judged) / n,
            parse_with_body_rate=sum(j["with_body"] for j in judged) / n,
            ended_rate=sum(j["ended"] for j in judged) / n,
        )
        samples += [{"variant": variant, "prompt": p, **j} for p, j in zip(prompts, judged)]
    (out / "code_completions.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return ids

"""HLE judges: decide whether a response's final answer matches the gold answer.

``ExactMatchJudge`` is built in and needs nothing. ``LLMJudge`` asks a model, through a
``ChatBackend``: any OpenAI-compatible endpoint (``HttpChatBackend``, stdlib urllib only) or our
own engine (``GeneratorBackend``). Its answers are cached on disk keyed by (judge, prompt), so a
rescore with the same judge is free and a different judge rescoring saved generations is cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from deepinfer_eval.extract import (
    final_part,
    hle_confidence,
    hle_extract,
    is_hedged_choice,
    multiple_choice_letter,
    normalize_exact,
)


@dataclass
class JudgeItem:
    question: str
    response: str | None
    answer: str
    answer_type: str  # exactMatch / multipleChoice


@dataclass
class Verdict:
    correct: bool
    extracted: str | None
    confidence: float | None = None  # in [0, 1]
    error: str | None = None  # the judge failed; the sample counts as wrong and is not cached


class Judge(Protocol):
    name: str

    def judge(self, items: list[JudgeItem]) -> list[Verdict]: ...


class ExactMatchJudge:
    """The answer line must equal the gold answer up to case, spacing, $...$ and a final period;
    for multiple choice, the option letter it starts with must equal the gold letter, and an answer
    naming several options ("B or C") is wrong, as HLE's judge criteria have it.
    `accept_hedged=True` is the lenient mode that grades such an answer on its first letter."""

    name = "exact"

    def __init__(self, accept_hedged: bool = False) -> None:
        self.accept_hedged = accept_hedged

    def judge(self, items: list[JudgeItem]) -> list[Verdict]:
        return [self._one(item) for item in items]

    def _one(self, item: JudgeItem) -> Verdict:
        extracted = hle_extract(item.response)
        confidence = hle_confidence(item.response)
        if extracted is None:
            return Verdict(False, None, confidence)
        if item.answer_type == "multipleChoice":
            if not self.accept_hedged and is_hedged_choice(extracted):
                return Verdict(False, extracted, confidence)
            letter = multiple_choice_letter(extracted)
            gold = multiple_choice_letter(item.answer) or item.answer.strip().upper()
            return Verdict(letter is not None and letter == gold, letter or extracted, confidence)
        return Verdict(normalize_exact(extracted) == normalize_exact(item.answer), extracted, confidence)


# ---------------------------------------------------------------------------------------------
# LLM judge. The criteria follow HLE's official judge, restated in our own words.

JUDGE_TEMPLATE = """You are grading an answer to an exam question. Decide only whether the final \
answer given in the response agrees with the reference answer; do not solve the question yourself \
and do not judge the reasoning.

[question]
{question}

[response]
{response}

[reference answer]
{answer}

Reply with exactly these four lines:
extracted_final_answer: <the final answer stated in the response, copied exactly; None if it states no final answer>
reasoning: <one or two sentences on whether the extracted answer and the reference answer differ in any way that matters; \
ignore wording, but any real difference, ambiguity or answer that is not equivalent makes it wrong>
correct: <yes if the extracted answer matches the reference answer, or for a numerical answer lies within a \
small margin of error of it; no otherwise, including when there is no final answer>
confidence: <the confidence from 0 to 100 that the response states for its answer; 100 if it states none>"""

_FIELD = re.compile(
    r"^[ \t*_]*(extracted_final_answer|correct|confidence)[ \t*_]*:[ \t*_]*(.*?)[ \t*_]*$", re.I | re.M
)


def parse_judge_reply(reply: str) -> Verdict:
    """Verdict from the four-line reply; a reply without a yes/no verdict is a judge error."""
    fields: dict[str, str] = {}
    for key, value in _FIELD.findall(reply):
        fields[key.lower()] = value.strip()
    correct = fields.get("correct", "").lower()
    if correct not in ("yes", "no"):
        return Verdict(False, None, error=f"judge reply has no 'correct: yes/no' line: {reply[:200]!r}")
    extracted = fields.get("extracted_final_answer")
    if extracted is not None and extracted.lower() in ("none", ""):
        extracted = None
    confidence = None
    m = re.match(r"(\d+(?:\.\d+)?)", fields.get("confidence", ""))
    if m:
        confidence = min(max(float(m.group(1)) / 100.0, 0.0), 1.0)
    return Verdict(correct == "yes", extracted, confidence)


class ChatBackend(Protocol):
    name: str  # identifies the judge model in the cache key

    def complete(self, prompts: list[str]) -> list[str | Exception]: ...


class HttpChatBackend:
    """``POST {base_url}/chat/completions`` of an OpenAI-compatible server, greedy, in parallel."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        max_tokens: int = 4096,
        workers: int = 8,
        retries: int = 2,
        backoff_s: float = 2.0,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"judge URL must start with http:// or https://, got {base_url!r}")
        if workers < 1:
            raise ValueError(f"judge workers must be >= 1, got {workers}")
        if retries < 0:
            raise ValueError(f"judge retries must be >= 0, got {retries}")
        self.retries, self.backoff_s = retries, backoff_s
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key, self.timeout_s, self.max_tokens, self.workers = (
            model,
            api_key,
            timeout_s,
            max_tokens,
            workers,
        )
        self.name = f"openai:{model}@{base_url.rstrip('/')}"

    def _one(self, prompt: str) -> str | Exception:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0.0,
            "max_tokens": self.max_tokens,
        }
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    data = json.load(reply)
                # a reasoning judge may inline its thinking; the verdict lines follow it
                return final_part(data["choices"][0]["message"]["content"] or "")
            except urllib.error.HTTPError as e:
                error: Exception = e
                if e.code != 429 and e.code < 500:  # a bad request will not get better
                    break
            except (urllib.error.URLError, OSError) as e:  # connection refused, reset, timeout
                error = e
            except (ValueError, KeyError, IndexError, TypeError) as e:  # not an OpenAI-style reply
                error = e
                break
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        return error  # one failed call costs one sample, never the run

    def complete(self, prompts):
        with ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(self._one, prompts))


class GeneratorBackend:
    """Judge with any ``Generator`` (e.g. our engine, at temperature 0): one sample per prompt."""

    def __init__(self, generator, name: str):
        self.generator, self.name = generator, f"generator:{name}"

    def complete(self, prompts):
        outs = self.generator.generate(
            [[{"role": "user", "content": p}] for p in prompts], 1, [0] * len(prompts)
        )
        replies: list[str | Exception] = []
        for out in outs:
            text = getattr(out[0], "text", out[0]) if out else None
            if text is None:
                replies.append(RuntimeError(getattr(out[0], "error", None) or "judge request failed"))
            else:  # a reasoning judge thinks first; only its final part holds the four lines
                replies.append(final_part(text))
        return replies


class JudgeCache:
    """Append-only JSONL of judge replies keyed by sha256(judge name, prompt)."""

    def __init__(self, path: str | os.PathLike | None):
        self.path, self.entries = path, {}
        if path and os.path.exists(path):
            from deepinfer_eval.records import read_jsonl

            for r in read_jsonl(path, required=("key", "reply")).records:
                self.entries[r["key"]] = r["reply"]

    @staticmethod
    def key(judge: str, prompt: str) -> str:
        return hashlib.sha256(json.dumps([judge, prompt]).encode()).hexdigest()

    def add(self, items: list[tuple[str, str]]) -> None:
        for key, reply in items:
            self.entries[key] = reply
        if self.path and items:
            from deepinfer_eval.records import JsonlAppender

            with JsonlAppender(self.path) as out:
                out.write({"key": k, "reply": r} for k, r in items)


class LLMJudge:
    """Asks the backend in chunks and caches each chunk's replies at once, so an interrupted
    scoring run keeps the judge answers it already paid for."""

    def __init__(
        self, backend: ChatBackend, cache: JudgeCache | None = None, chunk: int = 64, progress: bool = True
    ):
        if chunk < 1:
            raise ValueError(f"judge chunk must be >= 1, got {chunk}")
        self.backend, self.cache, self.chunk, self.progress = (
            backend,
            cache or JudgeCache(None),
            chunk,
            progress,
        )
        self.name = f"llm:{backend.name}"
        self.calls = 0  # backend calls made (cache misses), for the report and tests

    def judge(self, items: list[JudgeItem]) -> list[Verdict]:
        prompts = [self.prompt(item) for item in items]
        keys = [JudgeCache.key(self.name, p) for p in prompts]
        first: dict[str, int] = {}  # identical prompts are asked once
        for i, (item, key) in enumerate(zip(items, keys)):
            if final_part(item.response).strip() and key not in self.cache.entries:
                first.setdefault(key, i)
        todo = list(first.values())
        errors: dict[str, str] = {}
        from tqdm import tqdm

        with tqdm(total=len(todo), desc="judge", unit="call", disable=not (self.progress and todo)) as bar:
            for start in range(0, len(todo), self.chunk):
                part = todo[start : start + self.chunk]
                replies = self.backend.complete([prompts[i] for i in part])
                self.calls += len(part)
                fresh = []
                for i, reply in zip(part, replies):
                    if isinstance(reply, Exception):
                        errors[keys[i]] = f"judge call failed: {type(reply).__name__}: {reply}"
                    elif parse_judge_reply(reply).error is None:
                        fresh.append((keys[i], reply))
                    else:  # unusable replies are not cached: the next rescore asks again
                        errors[keys[i]] = parse_judge_reply(reply).error
                self.cache.add(fresh)
                bar.update(len(part))
        verdicts = []
        for item, key in zip(items, keys):
            if not final_part(item.response).strip():
                verdicts.append(Verdict(False, None))  # nothing to judge: wrong, as officially
            elif key in errors:
                verdicts.append(Verdict(False, None, error=errors[key]))
            else:
                verdicts.append(parse_judge_reply(self.cache.entries[key]))
        return verdicts

    @staticmethod
    def prompt(item: JudgeItem) -> str:
        return JUDGE_TEMPLATE.format(
            question=item.question, response=final_part(item.response), answer=item.answer
        )

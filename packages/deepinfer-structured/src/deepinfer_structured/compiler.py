"""Compile structured-output requests with xgrammar: worker threads, a cache, a deadline.

One GrammarCompileService per engine (per tokenizer / LM-head width). `submit()` validates the
request at once (so a bad schema fails when the request is added, before it takes a slot) and
compiles in a worker thread; xgrammar releases the GIL while compiling, so the engine loop keeps
running. The cache maps (schema type, canonical schema text, JSON whitespace options) to the
compile's future, so concurrent requests with the same schema share one compile, and failures are
remembered too. A compile that misses its deadline fails only its request; the thread cannot be
killed, so it finishes in the background and a later request with the same schema reuses it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import xgrammar as xg

from .errors import StructuredOutputError, from_xgrammar
from .grammar_state import GrammarState
from .so_args import StructuredOutputRequest, parse_so_args


def _size(future: Future) -> int:
    if future.done() and future.exception() is None:
        return future.result().memory_size_bytes
    return 0


_WHAT = {
    "json_schema": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "ebnf": "EBNF grammar",
}


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    entries: int = 0


class PendingGrammar:
    """A compile in flight. `poll()` for the engine loop, `result()` to block."""

    def __init__(self, request: StructuredOutputRequest, future: Future, deadline: float, timeout_s: float):
        self.request = request
        self._future = future
        self._deadline = deadline
        self._timeout_s = timeout_s

    def poll(self) -> xg.CompiledGrammar | None:
        """The compiled grammar, or None while compiling; raises StructuredOutputError on failure
        or once the deadline (counted from submission) has passed."""
        if self._future.done():
            return self._unwrap(0.0)
        if time.monotonic() >= self._deadline:
            self._raise_timeout()
        return None

    def result(self) -> xg.CompiledGrammar:
        """Block until compiled (raises StructuredOutputError on failure or timeout)."""
        return self._unwrap(max(0.0, self._deadline - time.monotonic()))

    def _unwrap(self, wait_s: float) -> xg.CompiledGrammar:
        try:
            return self._future.result(timeout=wait_s)
        except FutureTimeout:
            self._raise_timeout()
        except StructuredOutputError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError with its parser's message
            raise from_xgrammar("schema", _WHAT[self.request.schema_type], exc) from None

    def _raise_timeout(self) -> None:
        raise StructuredOutputError(
            "schema", f"grammar compilation did not finish within {self._timeout_s:g} s (compile timeout)"
        )


class GrammarCompileService:
    """Compiles so_args into xgrammar CompiledGrammars for one tokenizer / LM-head width.

    Args:
        tokenizer_info: from `tokenizer_info_from_file` (its vocab_size is the mask width).
        max_threads: worker threads (and xgrammar's own threads per compile).
        cache_entries: compiled grammars kept (least recently used dropped); 0 disables caching
            (the reference's DEEPINFER_XGRAMMAR_DISABLE_CACHE).
        cache_limit_bytes: also drop least recently used grammars while the finished ones hold
            more than this (<= 0: no byte limit; DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES).
        timeout_s: compile deadline per request, counted from `submit` (DEEPINFER_XGRAMMAR_TIMEOUT,
            20 s in the reference).
    """

    def __init__(
        self,
        tokenizer_info: xg.TokenizerInfo,
        *,
        max_threads: int = 2,
        cache_entries: int = 256,
        cache_limit_bytes: int = 10 << 30,
        timeout_s: float = 20.0,
    ):
        if max_threads < 1:
            raise ValueError(f"max_threads: must be >= 1, got {max_threads}")
        if cache_entries < 0:
            raise ValueError(f"cache_entries: must be >= 0, got {cache_entries}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.tokenizer_info = tokenizer_info
        self.vocab_size = tokenizer_info.vocab_size
        # What every GrammarState of this tokenizer needs; read once (slow through xgrammar's FFI).
        self.never_tokens = frozenset(tokenizer_info.special_token_ids)
        # Our cache is keyed the way requests are; xgrammar's own cache would only duplicate it.
        self._compiler = xg.GrammarCompiler(tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="so-compile")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._cache_entries = cache_entries
        self._cache_limit_bytes = cache_limit_bytes
        self._lock = threading.Lock()
        self._timeout_s = timeout_s
        self.stats = CacheStats()

    def submit(self, so_args: dict | StructuredOutputRequest) -> PendingGrammar:
        """Validate (raises StructuredOutputError now) and start compiling (errors come from poll)."""
        request = parse_so_args(so_args)
        fields = [("trigger_token_ids", t) for t in request.trigger_token_ids]
        if request.bound_token_id is not None:
            fields.append(("bound_token_id", request.bound_token_id))
        for field, token in fields:  # each named by its own key
            if token >= self.vocab_size:
                raise StructuredOutputError(
                    field, f"token id {token} is outside the vocabulary [0, {self.vocab_size})"
                )
        deadline = time.monotonic() + self._timeout_s
        with self._lock:
            future = self._cache.get(request.cache_key)
            if future is not None:
                self._cache.move_to_end(request.cache_key)
                self.stats.hits += 1
            else:
                self.stats.misses += 1
                future = self._pool.submit(self._compile, request)
                if self._cache_entries:
                    self._cache[request.cache_key] = future
                    self._evict()
            self.stats.entries = len(self._cache)
        return PendingGrammar(request, future, deadline, self._timeout_s)

    def compile(self, so_args: dict | StructuredOutputRequest) -> xg.CompiledGrammar:
        """Blocking submit + result."""
        return self.submit(so_args).result()

    def new_state(self, so_args: dict | StructuredOutputRequest) -> GrammarState:
        """Blocking: a fresh per-request GrammarState (convenience for tests and simple callers)."""
        pending = self.submit(so_args)
        return GrammarState(pending.result(), pending.request, self.never_tokens)

    def _evict(self) -> None:
        """Drop least recently used entries beyond the entry and byte limits (lock held)."""
        while len(self._cache) > self._cache_entries:
            self._cache.popitem(last=False)
        if self._cache_limit_bytes <= 0:
            return
        sizes = {key: _size(f) for key, f in self._cache.items()}
        total = sum(sizes.values())
        for key in list(self._cache)[:-1]:  # never drop the entry just added
            if total <= self._cache_limit_bytes:
                break
            total -= sizes[key]
            del self._cache[key]

    def cache_bytes(self) -> int:
        """Memory held by the finished compiled grammars in the cache."""
        with self._lock:
            return sum(_size(f) for f in self._cache.values())

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self.stats.entries = 0

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, request: StructuredOutputRequest) -> xg.CompiledGrammar:
        kind, text = request.schema_type, request.schema_text
        if kind in ("json_schema", "json_object"):
            # Strict mode (as the reference): no properties / items the schema does not name.
            schema = text if kind == "json_schema" else '{"type": "object"}'
            return self._compiler.compile_json_schema(
                schema,
                any_whitespace=request.any_whitespace,
                max_whitespace_cnt=request.max_whitespace,
                strict_mode=kind == "json_schema",
            )
        if kind == "regex":
            return self._compiler.compile_regex(text)
        return self._compiler.compile_grammar(text)

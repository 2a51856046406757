"""Scheduler configuration: validated once, in the C++ core, so both layers agree on the rules."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_sched._core import EngineType, _NativeConfig


def _engine_type(value: EngineType | str) -> EngineType:
    if isinstance(value, EngineType):
        return value
    names = {name.lower(): member for name, member in EngineType.__members__.items()}
    key = str(value).lower()
    if key not in names:
        raise ValueError(f"engine_type must be one of {sorted(names)}, got {value!r}")
    return names[key]


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Budgets and pool sizes of one scheduler.

    - ``num_blocks`` KV blocks of ``block_size`` tokens (a power of two; 128 by default, 64 works too);
      at least ``ceil(max_model_len / block_size)`` so one full-length sequence fits.
    - ``max_num_seqs`` sequences and ``max_num_batched_tokens`` query tokens per step (at least one
      block's worth).
    - ``max_model_len``: most tokens (prompt + output) of one sequence.
    - ``enable_prefix_caching``: reuse the KV of identical full-block prefixes (on by default).
    - ``enable_chunked_prefill``: split long prompts over steps (otherwise a prompt runs whole).
    - ``engine_type``: NORMAL, PROMPT (prefill only) or COMPLETION (decode only); a string works too.
    - ``num_speculative_tokens``: drafts verified per step at most, and the number assumed when a step
      is scheduled ahead of the unprocessed one (0: none assumed ahead and no cap on the drafts set, as for
      an engine that verifies drafts only in steps scheduled with nothing in flight).
    - ``prefix_hash_bits``: bits kept of each prefix-cache key; only tests lower it, to force hash
      collisions (hits are confirmed token by token, so collisions cost time, never correctness).
    - ``finish_preempted``: a sequence preempted for want of KV blocks finishes (reason "preempted",
      with the tokens it has) instead of waiting to be recomputed; COMPLETION engines always do.
    - ``report_evictions``: each output lists the cached blocks its schedule evicted
      (``SchedulerOutput.evicted_blocks``), for a lower KV tier to keep; a tier's keys are given back with
      ``Scheduler.add_loadable`` and hits on them come as ``SchedulerOutput.block_loads``.
    """

    num_blocks: int
    block_size: int = 128
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    engine_type: EngineType = EngineType.NORMAL
    num_speculative_tokens: int = 0
    prefix_hash_bits: int = 64
    finish_preempted: bool = False
    report_evictions: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine_type", _engine_type(self.engine_type))
        for name in (
            "num_blocks",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "num_speculative_tokens",
            "prefix_hash_bits",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
            if not -(2**31) <= value < 2**31:
                raise ValueError(f"{name} must fit in int32, got {value}")
        for name in ("finish_preempted", "report_evictions"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.to_native()  # raises ValueError naming the field and its allowed range

    def to_native(self) -> _NativeConfig:
        return _NativeConfig(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=bool(self.enable_prefix_caching),
            enable_chunked_prefill=bool(self.enable_chunked_prefill),
            engine_type=self.engine_type,
            num_speculative_tokens=self.num_speculative_tokens,
            prefix_hash_bits=self.prefix_hash_bits,
            finish_preempted=self.finish_preempted,
            report_evictions=self.report_evictions,
        )

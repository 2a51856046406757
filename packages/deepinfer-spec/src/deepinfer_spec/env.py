"""The reference's speculative-decoding knobs (engine spec §1.5), read through the one registry of
DeepInfer's environment variables (`deepinfer_cluster.envs`), where they are declared and validated."""

from __future__ import annotations

from collections.abc import Mapping

from deepinfer_cluster import envs

DEFAULT_NEXTN: int = envs.VARS["DEEPINFER_USE_NEXTN_DECODE"].default
MAX_NEXTN = envs.MAX_NEXTN  # the drafter's block is at most 32 tokens (v41 spec §7)


def nextn_from_env(environ: Mapping[str, str] | None = None) -> int:
    """`DEEPINFER_USE_NEXTN_DECODE` (default 5; 0 disables speculative decoding)."""
    return envs.get("DEEPINFER_USE_NEXTN_DECODE", environ)


def varlen_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """`DEEPINFER_ENABLE_MTP_VARLEN` (default on: the engine's draft policy; seeded sampled tokens do not
    depend on it under coupled verification, only under rejection sampling)."""
    return envs.get("DEEPINFER_ENABLE_MTP_VARLEN", environ)


def sampled_verify_from_env(environ: Mapping[str, str] | None = None) -> str:
    """`DEEPINFER_SPEC_SAMPLED_VERIFY` (default "coupled": seeded sampled tokens equal the drafts-off
    tokens, whichever steps verify drafts; "rejection": rejection sampling, higher acceptance when q is
    near p, tokens depend on which steps verified drafts)."""
    return envs.get("DEEPINFER_SPEC_SAMPLED_VERIFY", environ)


def probe_budget_from_env(environ: Mapping[str, str] | None = None) -> float:
    """`DEEPINFER_SPEC_PROBE_BUDGET` (default 0.05): the share of the plain decode time the draft policy's
    probes may add (`DraftPolicy.probe_budget`)."""
    return envs.get("DEEPINFER_SPEC_PROBE_BUDGET", environ)

"""The printed summary table of a bench run (rich)."""

from __future__ import annotations

from rich.table import Table


def _kept(r: dict) -> str:
    return f"{r['intervals']}/{r['dropped_flagged_intervals']}"


# (column header, cell of a record) per phase: one spec per table, one loop prints them all
PREFILL_COLUMNS = [
    ("chunk", lambda r: str(r["chunk_tokens"])),
    ("context", lambda r: str(r["context_tokens"])),
    ("kept/dropped", _kept),
    ("chunk ms", lambda r: f"{r['chunk_latency_ms']:.2f}"),
    ("tok/s/GPU", lambda r: f"{r['non_cached_tok_per_s_per_gpu']:.1f}"),
    ("roofline tok/s/GPU", lambda r: f"{r['roofline_tok_per_s_per_gpu']:.3g}"),
    ("of roof", lambda r: f"{r['fraction_of_roofline']:.2%}"),
    ("peak GiB", lambda r: f"{r['peak_device_memory_gib']:.1f}" if "peak_device_memory_gib" in r else "-"),
]
DECODE_COLUMNS = [
    ("batch", lambda r: str(r["batch"])),
    ("nextn", lambda r: str(r["nextn"])),
    ("kept/dropped", _kept),
    ("ms/step", lambda r: f"{r['ms_per_step']:.2f}"),
    ("full tok/s/GPU", lambda r: f"{r['full_acceptance_tok_per_s_per_gpu']:.1f}"),
    ("full tok/s/user", lambda r: f"{r['full_acceptance_tok_per_s_per_user']:.1f}"),
    ("measured tok/s/GPU", lambda r: f"{r['measured_tok_per_s_per_gpu']:.1f}"),
    ("measured tok/s/user", lambda r: f"{r['measured_tok_per_s_per_user']:.1f}"),
    ("tok/req-step", lambda r: f"{r['measured_tokens_per_request_step']:.2f}"),
    ("of roof", lambda r: f"{r['fraction_of_roofline']:.2%}"),
]
TITLES = {
    "prefill": "prefill (non-cached tokens; flagged intervals dropped)",
    "decode": "decode (full acceptance = steps/s x batch x (1+nextn) / cp; measured = emitted tokens)",
}


def print_table(console, rows: list[dict]) -> None:
    for phase, columns in (("prefill", PREFILL_COLUMNS), ("decode", DECODE_COLUMNS)):
        records = [r for r in rows if r["phase"] == phase]
        if not records:
            continue
        t = Table(title=TITLES[phase])
        for header, _ in columns:
            t.add_column(header, justify="right")
        for r in records:
            t.add_row(*(cell(r) for _, cell in columns))
        console.print(t)

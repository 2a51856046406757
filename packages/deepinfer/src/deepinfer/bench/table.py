"""The printed summary table of a bench run (rich)."""

from __future__ import annotations

from rich.table import Table


def print_table(console, rows: list[dict]) -> None:
    prefill = [r for r in rows if r["phase"] == "prefill"]
    decode = [r for r in rows if r["phase"] == "decode"]
    if prefill:
        t = Table(title="prefill (non-cached tokens; flagged intervals dropped)")
        for col in (
            "chunk",
            "context",
            "kept/dropped",
            "chunk ms",
            "tok/s/GPU",
            "roofline tok/s/GPU",
            "of roof",
        ):
            t.add_column(col, justify="right")
        for r in prefill:
            t.add_row(
                str(r["chunk_tokens"]),
                str(r["context_tokens"]),
                f"{r['intervals']}/{r['dropped_flagged_intervals']}",
                f"{r['chunk_latency_ms']:.2f}",
                f"{r['non_cached_tok_per_s_per_gpu']:.1f}",
                f"{r['roofline_tok_per_s_per_gpu']:.3g}",
                f"{r['fraction_of_roofline']:.2%}",
            )
        console.print(t)
    if decode:
        t = Table(
            title="decode (full acceptance = steps/s x batch x (1+nextn) / cp; measured = emitted tokens)"
        )
        for col in (
            "batch",
            "nextn",
            "kept/dropped",
            "ms/step",
            "full tok/s/GPU",
            "full tok/s/user",
            "measured tok/s/GPU",
            "measured tok/s/user",
            "tok/req-step",
            "of roof",
        ):
            t.add_column(col, justify="right")
        for r in decode:
            t.add_row(
                str(r["batch"]),
                str(r["nextn"]),
                f"{r['intervals']}/{r['dropped_flagged_intervals']}",
                f"{r['ms_per_step']:.2f}",
                f"{r['full_acceptance_tok_per_s_per_gpu']:.1f}",
                f"{r['full_acceptance_tok_per_s_per_user']:.1f}",
                f"{r['measured_tok_per_s_per_gpu']:.1f}",
                f"{r['measured_tok_per_s_per_user']:.1f}",
                f"{r['measured_tokens_per_request_step']:.2f}",
                f"{r['fraction_of_roofline']:.2%}",
            )
        console.print(t)

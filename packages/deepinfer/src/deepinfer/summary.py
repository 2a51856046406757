"""The rich summary table printed after a generate run."""

from __future__ import annotations

import statistics

from rich.table import Table

from .outputs import RequestOutput


def summarize(outputs: list[RequestOutput], elapsed_s: float) -> dict:
    ok = [o for o in outputs if o.error is None]
    gen = sum(len(c.token_ids) for o in ok for c in o.outputs)
    prompt = sum(len(o.prompt_token_ids) for o in ok)
    ttft = [o.metrics.ttft for o in ok if o.metrics.ttft is not None]
    tpot = [o.metrics.tpot for o in ok if o.metrics.tpot is not None]
    return {
        "requests": len(outputs),
        "failed": len(outputs) - len(ok),
        "prompt_tokens": prompt,
        "output_tokens": gen,
        "elapsed_s": elapsed_s,
        "output_tok_per_s": gen / elapsed_s if elapsed_s > 0 else 0.0,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "tpot_mean_s": statistics.fmean(tpot) if tpot else None,
    }


def summary_table(outputs: list[RequestOutput], elapsed_s: float, engine=None) -> Table:
    s = summarize(outputs, elapsed_s)
    table = Table(title="deepinfer generate", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("requests (failed)", f"{s['requests']} ({s['failed']})")
    table.add_row("prompt tokens", str(s["prompt_tokens"]))
    table.add_row("output tokens", str(s["output_tokens"]))
    table.add_row("wall time", f"{s['elapsed_s']:.2f} s")
    table.add_row("output tokens/s", f"{s['output_tok_per_s']:.1f}")
    table.add_row("mean TTFT", "-" if s["ttft_mean_s"] is None else f"{s['ttft_mean_s'] * 1e3:.0f} ms")
    table.add_row("mean TPOT", "-" if s["tpot_mean_s"] is None else f"{s['tpot_mean_s'] * 1e3:.0f} ms")
    if engine is not None:
        st = engine.stats
        table.add_row("loop", "async" if engine.use_async else "sync")
        table.add_row(
            "schedule time (hidden)", f"{st.schedule_s * 1e3:.0f} ms ({st.hidden_schedule_s * 1e3:.0f} ms)"
        )
    return table

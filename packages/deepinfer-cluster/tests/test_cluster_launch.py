"""The launcher: environment of the ranks, layout errors before any start, gloo all-reduce
across CPU ranks, and a rank that fails taking the others down."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from deepinfer_cluster.launch import main

PY = sys.executable


def launch(*args: str, timeout: float = 90) -> tuple[int, str, str, float]:
    """Run the launcher as its own process (as users do) and time it."""
    start = time.monotonic()
    res = subprocess.run(
        [PY, "-m", "deepinfer_cluster.launch", *args], capture_output=True, text=True, timeout=timeout
    )
    return res.returncode, res.stdout, res.stderr, time.monotonic() - start


def test_rank_environment_and_output_prefix():
    code = (
        "import json, os; keys = ['RANK','LOCAL_RANK','WORLD_SIZE','LOCAL_WORLD_SIZE','MASTER_ADDR','MASTER_PORT',"
        "'DEEPINFER_DP_SIZE','DEEPINFER_CP_SIZE','DEEPINFER_EP_SIZE','NCCL_NVLS_ENABLE',"
        "'TORCH_SYMM_MEM_DISABLE_MULTICAST','NVSHMEM_DISABLE_NVLS']; print(json.dumps({k: os.environ.get(k) for k in keys}))"
    )
    rc, out, err, _ = launch("--nproc", "4", "--cp", "2", "--ep", "2", "--", PY, "-c", code)
    assert rc == 0, err
    seen = {}
    for line in out.splitlines():
        prefix, _, payload = line.partition("] ")
        env = json.loads(payload)
        assert prefix == f"[rank {env['RANK']}"
        seen[int(env["RANK"])] = env
    assert sorted(seen) == [0, 1, 2, 3]
    for rank, env in seen.items():
        assert env["LOCAL_RANK"] == str(rank) and env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "4"
        assert (env["DEEPINFER_DP_SIZE"], env["DEEPINFER_CP_SIZE"], env["DEEPINFER_EP_SIZE"]) == (
            "2",
            "2",
            "2",
        )
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert env["NVSHMEM_DISABLE_NVLS"] == "1"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == seen[0]["MASTER_PORT"]


def test_impossible_layout_fails_before_any_process_starts(tmp_path, capsys):
    marker = tmp_path / "started"
    rc = main(["--nproc", "4", "--cp", "3", "--", PY, "-c", f"open({str(marker)!r}, 'w')"])
    assert rc == 2 and not marker.exists()
    err = capsys.readouterr().err
    assert "cp=3 must divide the world size 4" in err and "world_size=4" in err
    assert main(["--nproc", "2", "--ep", "4", "--", "true"]) == 2
    assert "ep=4 must divide dp*cp = 2" in capsys.readouterr().err
    assert main(["--nproc", "2"]) == 2
    assert "COMMAND missing" in capsys.readouterr().err
    assert main(["--nnodes", "2", "--nproc", "1", "--", "true"]) == 2
    assert "--master-addr is required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0


def test_dry_run_shows_the_torchrun_command(capsys):
    rc = main(["--nnodes", "2", "--nproc", "4", "--node-rank", "1", "--master-addr", "10.0.0.1",
               "--master-port", "29500", "--ep", "8", "--dry-run", "--", "deepinfer", "generate"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "world_size=8, dp=8, cp=1, ep=8" in out
    assert "torch.distributed.run --nnodes=2 --nproc-per-node=4 --node-rank=1" in out
    assert "--master-addr=10.0.0.1 --master-port=29500 --no-python deepinfer generate" in out


def test_a_failing_rank_stops_the_others():
    # rank 2 fails; the others would sleep for 5 minutes
    code = (
        "import os, sys, time; r = os.environ['RANK']; print('rank', r, 'up', flush=True)\n"
        "if r == '2': print('giving up on purpose'); sys.exit(7)\n"
        "time.sleep(300)"
    )
    rc, out, err, took = launch("--nproc", "3", "--", PY, "-c", code)
    assert rc == 7
    assert took < 20
    assert "rank 2 (pid" in err and "exited with code 7" in err
    assert "still running [0, 1]" in err and "giving up on purpose" in err.split("deepinfer-launch: ")[1]
    assert "[rank 2] giving up on purpose" in out


def test_a_rank_killed_by_a_signal_is_reported():
    code = "import os, signal, time; r = os.environ['RANK']\nif r == '1': os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(300)"
    rc, _, err, took = launch("--nproc", "2", "--", PY, "-c", code)
    assert rc == 128 + 9 and took < 20
    assert "rank 1" in err and "killed by signal SIGKILL" in err


def test_missing_command_is_reported():
    rc, _, err, _ = launch("--nproc", "2", "--", "/nonexistent/deepinfer-command")
    assert rc == 127 and "cannot start" in err


ALLREDUCE = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.arange(4, dtype=torch.float64) + rank
dist.all_reduce(t)
expected = torch.arange(4, dtype=torch.float64) * world + world * (world - 1) / 2
assert torch.equal(t, expected), (t, expected)
print("sum", t.tolist(), flush=True)
if os.environ.get("CRASH_RANK") == str(rank):
    import time
    print("rank", rank, "crashing on purpose at", time.time(), flush=True)
    os._exit(3)
dist.all_reduce(t)  # the crashed rank never joins: without the launcher this waits forever
dist.destroy_process_group()
"""


@pytest.mark.distributed
def test_gloo_all_reduce_across_cpu_ranks():
    rc, out, err, _ = launch("--nproc", "3", "--", PY, "-c", ALLREDUCE, timeout=120)
    assert rc == 0, err
    sums = [line for line in out.splitlines() if "sum" in line]
    assert sorted(s.split("]")[0] for s in sums) == ["[rank 0", "[rank 1", "[rank 2"]
    assert all("[3.0, 6.0, 9.0, 12.0]" in s for s in sums)


@pytest.mark.distributed
def test_gloo_rank_crash_takes_the_others_down():
    import os

    env_code = "import os; os.environ['CRASH_RANK'] = '1'\n" + ALLREDUCE
    start = time.monotonic()
    res = subprocess.run(
        [PY, "-m", "deepinfer_cluster.launch", "--nproc", "2", "--kill-grace", "2", "--", PY, "-c", env_code],
        capture_output=True, text=True, timeout=120, env={**os.environ},
    )  # fmt: skip
    ended = time.time()
    assert res.returncode == 3, res.stderr
    report = res.stderr.split("deepinfer-launch: ")[1]
    assert report.startswith("rank 1 (pid") and "exited with code 3" in report
    assert "crashing on purpose" in report  # the failing rank's last lines
    crashed_at = float(next(x for x in res.stdout.splitlines() if "crashing" in x).split()[-1])
    assert ended - crashed_at < 15  # the run ends within seconds of the crash (grace 2 s)
    assert time.monotonic() - start < 90


def test_stopping_the_launcher_stops_every_rank():
    import signal

    import psutil

    code = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(300)"
    proc = subprocess.Popen(
        [PY, "-m", "deepinfer_cluster.launch", "--nproc", "2", "--", PY, "-c", code],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    pids = [int(proc.stdout.readline().split()[-1]) for _ in range(2)]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "interrupted by SIGTERM; all ranks stopped" in err
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)

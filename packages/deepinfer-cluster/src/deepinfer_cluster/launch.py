"""`deepinfer-launch`: start one process per rank with torchrun-compatible environment variables.

    deepinfer-launch [--nproc N | --nnodes M --node-rank R --master-addr A] [--dp D --cp C --ep E]
                     [--devices-per-rank K] [--bind-numa | --no-bind-numa] -- COMMAND [ARGS...]

Single host: this module starts the ranks itself, prefixes their output with "[rank i]", and
when one rank fails stops all others within `--kill-grace` seconds (SIGTERM to each rank's
process group, then SIGKILL), reporting the failing rank, its exit code and its last lines.
Several hosts: the same options are handed to torchrun (`python -m torch.distributed.run`), which
owns rendezvous and restarts; torch must be importable for that, this package does not need it.

NUMA: by default each local rank is pinned to its device's share of its NUMA node (CPU ranks: the
nodes split in contiguous blocks) where the host has more than one node; on a one-node host there is
nothing to choose and nothing is changed. What was decided is printed at start (`numa_decision`).
`--bind-numa` binds on one node too, `--no-bind-numa` never binds.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from deepinfer_cluster.accelerator import AcceleratorKind, accelerator_kind
from deepinfer_cluster.layout import ParallelLayout, resolve_layout
from deepinfer_cluster.multicast import NO_MULTICAST_ENV
from deepinfer_cluster.visible import devices_for_rank, visible_devices

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS picks it; racy only against other pickers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepinfer-launch",
        description="Start one process per rank (torchrun-compatible env); a failing rank stops all others.",
        epilog="Everything after '--' is the command each rank runs.",
    )
    p.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, help="ranks on this host")
    p.add_argument("--nnodes", type=int, default=1, help="hosts; >1 delegates to torchrun (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this host's index when --nnodes > 1")
    p.add_argument("--master-addr", default=None, help="rendezvous host (default 127.0.0.1 on one host)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free port)")
    p.add_argument("--dp", type=int, help="data-parallel size (default world/cp)")
    p.add_argument("--cp", type=int, help="context-parallel size (default 1; must divide the world size)")
    p.add_argument("--ep", type=int, help="expert-parallel size (default the world size)")
    p.add_argument(
        "--devices-per-rank",
        type=int,
        default=None,
        help="narrow CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES to K devices per rank",
    )
    p.add_argument(
        "--bind-numa",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pin each rank to its device's NUMA cores and memory before it starts (default: where "
        "the host has several NUMA nodes; --no-bind-numa: never)",
    )
    p.add_argument(
        "--kill-grace",
        type=float,
        default=3.0,
        help="seconds between SIGTERM and SIGKILL when stopping ranks (default 3)",
    )
    p.add_argument("--tail-lines", type=int, default=20, help="lines of a failed rank's output to report")
    p.add_argument("--dry-run", action="store_true", help="print what would run and exit")
    return p


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" not in argv:
        raise ValueError("COMMAND missing: put the command each rank runs after '--'")
    i = argv.index("--")
    command = argv[i + 1 :]
    if not command:
        raise ValueError("COMMAND missing: nothing follows '--'")
    return argv[:i], command


@dataclass
class Plan:
    layout: ParallelLayout
    nproc: int
    node_rank: int
    master_addr: str
    master_port: int
    command: list[str]
    rank_env: list[dict[str, str]] = field(default_factory=list)  # per local rank, on top of os.environ
    numa_binding: list[tuple[int, tuple[int, ...]] | None] = field(default_factory=list)
    numa_report: str = ""  # the binding decision, printed at start


def numa_decision(requested: bool | None, nodes) -> tuple[bool, str]:
    """Whether the launcher binds its ranks, and why. `requested`: --bind-numa (True), --no-bind-numa
    (False) or neither (None: bind where the host has several NUMA nodes); `nodes`: the host's
    `NumaNode`s."""
    count = len(nodes)
    if requested is False:
        return False, f"NUMA: not binding (--no-bind-numa; {count} node(s) on this host)"
    if count == 0:
        return False, "NUMA: no NUMA information on this host; ranks not bound"
    if requested is None and count == 1:
        return False, "NUMA: 1 node on this host; ranks not bound (nothing to choose)"
    why = "--bind-numa" if requested else f"{count} nodes on this host"
    return True, f"NUMA: binding each rank to its node's cores and memory ({why})"


def _local_world(args: argparse.Namespace, kind: AcceleratorKind) -> int | None:
    if args.nproc is not None:
        if args.nproc < 1:
            raise ValueError(f"--nproc={args.nproc} must be >= 1")
        return args.nproc
    if args.nnodes > 1:
        raise ValueError("--nproc is required with --nnodes > 1")
    if args.dp is None and args.ep is None:
        # like the reference: one rank per visible device
        n = len(visible_devices(kind)) if kind is not AcceleratorKind.CPU else 0
        if n == 0:
            raise ValueError(
                "--nproc is required: no accelerator devices visible to derive the world size from"
            )
        return n
    return None


def make_plan(
    args: argparse.Namespace, command: list[str], kind: AcceleratorKind | None = None, host=None
) -> Plan:
    """Everything decided before the first process starts; ValueError for impossible layouts.
    `host`: (devices, NUMA nodes) of the machine (default: probed here, when binding may apply)."""
    kind = accelerator_kind() if kind is None else kind
    if args.nnodes < 1:
        raise ValueError(f"--nnodes={args.nnodes} must be >= 1")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank={args.node_rank} out of range [0, {args.nnodes})")
    nproc = _local_world(args, kind)
    world = None if nproc is None else nproc * args.nnodes
    layout = resolve_layout(world, args.dp, args.cp, args.ep)
    if nproc is None:
        nproc = layout.world_size
    if args.nnodes > 1 and args.master_addr is None:
        raise ValueError("--master-addr is required with --nnodes > 1")
    addr = args.master_addr or "127.0.0.1"
    port = (
        args.master_port
        if args.master_port is not None
        else free_port(addr if args.nnodes == 1 else "0.0.0.0")
    )
    plan = Plan(layout, nproc, args.node_rank, addr, port, command)

    var = kind.visible_devices_var
    visible = visible_devices(kind) if var else []
    devices = nodes = None
    if args.bind_numa is not False:
        if host is None:
            from deepinfer_cluster.cpu import numa_nodes
            from deepinfer_cluster.devices import probe_devices

            host = probe_devices(), numa_nodes()
        devices, nodes = host
    bind, plan.numa_report = numa_decision(args.bind_numa, nodes or [])
    if not bind:
        devices = None
    for local in range(nproc):
        rank = args.node_rank * nproc + local
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(layout.world_size),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": str(args.node_rank),
            "NODE_RANK": str(args.node_rank),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
            **layout.env(),
            **NO_MULTICAST_ENV,
        }
        mine = None
        if args.devices_per_rank is not None:
            if var is None:
                raise ValueError("--devices-per-rank: this host has no accelerator devices")
            mine = devices_for_rank(local, args.devices_per_rank, visible)
            env[var] = ",".join(map(str, mine))
        plan.rank_env.append(env)
        plan.numa_binding.append(
            _numa_target(local, nproc, mine, visible, devices, nodes) if devices is not None else None
        )
    return plan


def _numa_target(local, nproc, mine, visible, devices, nodes):
    from deepinfer_cluster.binding import binding_target

    physical = mine[0] if mine else (visible[local] if local < len(visible) else None)
    return binding_target(local, nproc, devices, nodes, physical)


# ---------------------------------------------------------------------------------------------
# running the ranks of one host


class _Rank:
    def __init__(self, local: int, rank: int, proc: subprocess.Popen, tail_lines: int):
        self.local, self.rank, self.proc = local, rank, proc
        self.tail: collections.deque[str] = collections.deque(maxlen=max(1, tail_lines))
        self.readers: list[threading.Thread] = []


def _pump(rank: _Rank, stream, out, lock: threading.Lock) -> None:
    prefix = f"[rank {rank.rank}] "
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        rank.tail.append(line)
        with lock:
            out.write(prefix + line + "\n")
            out.flush()
    stream.close()


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stop(ranks: list[_Rank], grace: float) -> None:
    """SIGTERM every live rank's process group, SIGKILL what is left after `grace` seconds."""
    live = [r for r in ranks if r.proc.poll() is None]
    for r in live:
        _signal_group(r.proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for r in live:
        try:
            r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for r in live:
        # The group too: a rank's own children (e.g. dataloader workers) must not outlive it.
        _signal_group(r.proc, signal.SIGKILL)
        r.proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _binder(target):
    if target is None:
        return None
    node, cpus = target

    def bind() -> None:  # runs in the child between fork and exec; best effort
        from deepinfer_cluster.binding import bind_to_numa_node

        try:
            bind_to_numa_node(node, cpus)
        except (OSError, ValueError) as exc:
            os.write(2, f"deepinfer-launch: NUMA binding to node {node} failed: {exc}\n".encode())

    return bind


def run_local(plan: Plan, kill_grace: float = 3.0, tail_lines: int = 20, out=None, err=None) -> int:
    """Start the ranks of this host, stream their output, and return the run's exit code."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    base = dict(os.environ)
    base.setdefault("PYTHONUNBUFFERED", "1")  # rank output arrives line by line, not at exit
    base.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA indices = NVML / nvidia-smi indices
    if plan.nproc > 1:
        base.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: ranks must not oversubscribe cores
    ranks: list[_Rank] = []
    # SimpleQueue.put is reentrant, so the signal handler may use it too. Handlers go in before
    # the first child starts, so that no moment exists where a signal would orphan the ranks.
    exits: queue.SimpleQueue[tuple[_Rank | None, int]] = queue.SimpleQueue()
    interrupted: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda s, _f: (interrupted.append(s), exits.put((None, 0))))
    try:
        # Every child starts before any reader thread exists: preexec_fn (NUMA binding) is only
        # safe in a single-threaded parent.
        try:
            for local, env in enumerate(plan.rank_env):
                proc = subprocess.Popen(
                    plan.command,
                    env={**base, **env},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,  # own process group: stopping a rank stops its children
                    preexec_fn=_binder(plan.numa_binding[local] if plan.numa_binding else None),
                )
                ranks.append(_Rank(local, int(env["RANK"]), proc, tail_lines))
        except (OSError, subprocess.SubprocessError) as exc:
            _stop(ranks, kill_grace)
            err.write(f"deepinfer-launch: cannot start {plan.command[0]!r}: {exc}\n")
            return 127
        lock = threading.Lock()
        for r in ranks:
            for stream, sink in ((r.proc.stdout, out), (r.proc.stderr, err)):
                t = threading.Thread(target=_pump, args=(r, stream, sink, lock), daemon=True)
                t.start()
                r.readers.append(t)
            threading.Thread(target=lambda r=r: exits.put((r, r.proc.wait())), daemon=True).start()

        failed: tuple[_Rank, int] | None = None
        running: list[int] = []
        done = 0
        while done < len(ranks) and not interrupted:
            try:
                r, code = exits.get(timeout=0.5)  # a timeout keeps the loop responsive to signals
            except queue.Empty:
                continue
            if r is None:  # the launcher itself was interrupted
                break
            done += 1
            if code != 0:
                failed = (r, code)
                running = [x.rank for x in ranks if x.proc.poll() is None]
                break
        _stop(ranks, kill_grace)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for r in ranks:
        for t in r.readers:
            t.join(timeout=2.0)
    if interrupted:
        err.write(
            f"deepinfer-launch: interrupted by {signal.Signals(interrupted[0]).name}; all ranks stopped\n"
        )
        return 128 + interrupted[0]
    if failed is None:
        return 0
    r, code = failed
    lines = "\n".join(f"    {line}" for line in r.tail) or "    (no output)"
    err.write(
        f"deepinfer-launch: rank {r.rank} (pid {r.proc.pid}) {_describe_exit(code)}; "
        f"stopped the ranks still running {running}.\n  last {len(r.tail)} lines of rank {r.rank}:\n{lines}\n"
    )
    return code if code > 0 else 128 - code


# ---------------------------------------------------------------------------------------------
# several hosts: torchrun


def torchrun_command(plan: Plan, nnodes: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}", f"--nproc-per-node={plan.nproc}", f"--node-rank={plan.node_rank}",
        f"--master-addr={plan.master_addr}", f"--master-port={plan.master_port}",
        "--no-python", *plan.command,
    ]  # fmt: skip


def run_torchrun(plan: Plan, nnodes: int) -> int:
    if importlib.util.find_spec("torch") is None:
        raise ValueError(
            f"--nnodes={nnodes}: launching on several hosts goes through torchrun, and torch is not importable"
        )
    env = {**os.environ, **plan.layout.env(), **NO_MULTICAST_ENV}
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return subprocess.run(torchrun_command(plan, nnodes), env=env).returncode


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if "--" not in argv and any(a in ("-h", "--help") for a in argv):
        parser.parse_args(argv)  # prints help and exits
    try:
        opts, command = split_command(argv)
        args = parser.parse_args(opts)
        plan = make_plan(args, command)
        if plan.numa_report and args.nnodes == 1:
            bound = [f"{i}->{b[0]}" for i, b in enumerate(plan.numa_binding) if b is not None]
            extra = f": local rank->node {', '.join(bound)}" if bound else ""
            sys.stderr.write(
                f"[deepinfer-launch] {plan.numa_report}{extra}\n"
            )  # (errors: "deepinfer-launch: ...")
        if args.dry_run:
            _print_plan(plan, args.nnodes)
            return 0
        if args.nnodes > 1:
            return run_torchrun(plan, args.nnodes)
    except ValueError as exc:
        sys.stderr.write(f"deepinfer-launch: error: {exc}\n")
        return 2
    return run_local(plan, args.kill_grace, args.tail_lines)


def _print_plan(plan: Plan, nnodes: int) -> None:
    print(f"layout: {plan.layout.describe()}; master {plan.master_addr}:{plan.master_port}")
    if nnodes > 1:
        print("torchrun: " + " ".join(torchrun_command(plan, nnodes)))
        return
    for env, bind in zip(plan.rank_env, plan.numa_binding or [None] * len(plan.rank_env)):
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")
        shown = " ".join(f"{k}={env[k]}" for k in keys if k in env)
        where = f" numa={bind[0]} cpus={list(bind[1])}" if bind else ""
        print(f"{shown}{where}: {' '.join(plan.command)}")


if __name__ == "__main__":
    sys.exit(main())

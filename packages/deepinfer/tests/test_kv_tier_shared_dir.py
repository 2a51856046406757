"""Engines running at the same time on one disk tier directory: each sees the files the others write and
forgets those they delete (`KVTier.refresh`), keeps the directory within its budget, and never deletes a
file another live process is still writing. Two `KVTier`s stand in for two engines; the engine-level
hand-off (a vanished file costs a recompute) is in test_kv_tier_engine.py."""

import os
import subprocess
import sys

import pytest
import torch
from deepinfer.engine.kv_tier import RESCAN_S, SUFFIX, KVTier, TierSettings, key_name
from deepinfer_model import BlockPayload

FP = "same-model"


def entry(i: int) -> BlockPayload:
    pools = {"kv": torch.full((1, 4, 8), float(i)), "index": torch.arange(8.0).reshape(1, 4, 2) + i}
    return BlockPayload(4, pools, {"hash": i, "check": i + 1})


def tier(path, disk_bytes=1 << 20) -> KVTier:
    return KVTier(TierSettings(host_bytes=0, disk_bytes=disk_bytes, disk_dir=str(path)), FP)


def test_an_engine_sees_what_another_wrote_and_forgets_what_it_deleted(tmp_path):
    a, b = tier(tmp_path), tier(tmp_path)
    assert b.refresh(now=1e9) == ([], [])
    for i in range(3):
        assert a.store((i, i + 1), entry(i)) == []
    assert (1, 2) not in b
    appeared, gone = b.refresh(now=2e9)
    assert sorted(appeared) == [(0, 1), (1, 2), (2, 3)] and gone == []
    payload, where = b.fetch((1, 2))
    assert where == "disk" and torch.equal(payload.pools["kv"], entry(1).pools["kv"])
    assert b.disk_bytes == a.disk_bytes
    # not before RESCAN_S has passed since the last look
    a.discard((0, 1))
    assert b.refresh(now=2e9 + RESCAN_S / 2) == ([], [])
    assert b.refresh(now=2e9 + RESCAN_S) == ([], [(0, 1)])
    assert (0, 1) not in b and b.disk_bytes == a.disk_bytes


def test_a_file_deleted_under_a_reader_fails_its_fetch_and_leaves_the_tier(tmp_path):
    a, b = tier(tmp_path), tier(tmp_path)
    a.store((5, 6), entry(5))
    b.refresh(now=1e9)
    a.discard((5, 6))
    with pytest.raises(OSError):
        b.fetch((5, 6))
    assert (5, 6) not in b


def test_the_budget_holds_for_the_directory(tmp_path):
    tier(tmp_path / "probe").store((9, 9), entry(9))
    one = next((tmp_path / "probe" / FP).iterdir()).stat().st_size
    a, b = tier(tmp_path, disk_bytes=3 * one), tier(tmp_path, disk_bytes=3 * one)
    for i in range(2):
        a.store((i, 0), entry(i))
    for i in range(2, 4):
        b.store((i, 0), entry(i))
    # b finds a's two files: with its own two they exceed the budget, and the oldest goes
    _, gone = b.refresh(now=1e9)
    assert len(list((tmp_path / FP).glob("*" + SUFFIX))) == 3 and gone == [(0, 0)]


def test_a_starting_engine_keeps_a_live_writers_file_and_removes_a_dead_ones(tmp_path):
    d = tmp_path / FP
    d.mkdir()
    live = d / f"{key_name((1, 2))}{SUFFIX}.tmp{os.getpid()}"
    dead_pid = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = d / f"{key_name((3, 4))}{SUFFIX}.tmp{int(dead_pid.stdout)}"
    live.write_bytes(b"half-written")
    dead.write_bytes(b"left by a crash")
    tier(tmp_path)
    assert live.exists() and not dead.exists()

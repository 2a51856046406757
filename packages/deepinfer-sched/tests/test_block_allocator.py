import deepinfer_sched
import pytest
from deepinfer_sched import BlockAllocator


def test_build_info_records_accelerator():
    info = deepinfer_sched.build_info()
    assert info["accelerator"] in {"cpu", "nvidia"}


def test_allocate_free_refcount_cycle():
    alloc = BlockAllocator(3)
    ids = [alloc.allocate() for _ in range(3)]
    assert sorted(ids) == [0, 1, 2]
    assert alloc.num_free == 0 and alloc.num_used == 3
    with pytest.raises(RuntimeError, match="no free KV blocks"):
        alloc.allocate()
    alloc.incref(ids[0])
    assert alloc.ref_count(ids[0]) == 2
    assert alloc.decref(ids[0]) is False
    assert alloc.decref(ids[0]) is True
    assert alloc.num_free == 1
    assert alloc.allocate() == ids[0]


def test_bad_ids_and_sizes_are_rejected():
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockAllocator(0)
    alloc = BlockAllocator(2)
    with pytest.raises(IndexError, match=r"block_id must be in \[0, 2\)"):
        alloc.decref(5)
    with pytest.raises(RuntimeError, match="already free"):
        alloc.decref(1)

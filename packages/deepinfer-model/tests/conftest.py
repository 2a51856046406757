"""Shared test settings of deepinfer-model."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The tiny models' matrices gain nothing from intra-op threads; on a shared 2-core runner extra
    threads only add synchronisation stalls. Restored after each module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

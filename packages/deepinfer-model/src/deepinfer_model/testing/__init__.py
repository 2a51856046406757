"""Test and demo helpers: tiny configs and random checkpoints in the real (upstream) layout."""

from .checkpoint import copy_tokenizer, make_checkpoint, tiny_config
from .draft_reference import PerRowDraftReference
from .no_sync import HostSyncError, count_ops, no_host_sync
from .sequences import batch_of, grow_tables
from .strict_device import StrictDevice, strict_device

__all__ = [
    "HostSyncError",
    "PerRowDraftReference",
    "StrictDevice",
    "batch_of",
    "copy_tokenizer",
    "count_ops",
    "grow_tables",
    "make_checkpoint",
    "no_host_sync",
    "strict_device",
    "tiny_config",
]

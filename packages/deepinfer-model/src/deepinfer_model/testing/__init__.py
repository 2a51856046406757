"""Test and demo helpers: tiny configs and random checkpoints in the real (upstream) layout."""

from .checkpoint import copy_tokenizer, make_checkpoint, tiny_config
from .strict_device import StrictDevice, strict_device

__all__ = ["StrictDevice", "copy_tokenizer", "make_checkpoint", "strict_device", "tiny_config"]

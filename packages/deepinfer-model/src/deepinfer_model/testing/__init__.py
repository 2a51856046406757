"""Test and demo helpers: tiny configs and random checkpoints in the real (upstream) layout."""

from .checkpoint import copy_tokenizer, make_checkpoint, tiny_config

__all__ = ["copy_tokenizer", "make_checkpoint", "tiny_config"]

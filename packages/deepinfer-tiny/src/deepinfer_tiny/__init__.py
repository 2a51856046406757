"""deepinfer-tiny: a small trained DeepSeek-V4.1 model with its DSpark drafter, and the recipe that made it.

Public API: `install(target)` writes the shipped checkpoint as a Hugging Face folder (weights verified
against their checksums, tokenizer and chat template added); `verify()` checks the shipped weights;
`revision()` names them; `WEIGHTS_DIR` is where they live. The recipe is `deepinfer_tiny.recipe`
(`python -m deepinfer_tiny.recipe.train --help`); the architecture is `deepinfer_tiny.architecture`.
"""

from .checkpoint import WEIGHTS_DIR, install, revision, verify

__all__ = ["WEIGHTS_DIR", "install", "revision", "verify"]

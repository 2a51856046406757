"""deepinfer-structured: regex / JSON schema / JSON object / EBNF constraints with xgrammar.

Public API (see README.md for the engine-loop recipe):
    parse_so_args, StructuredOutputRequest, StructuredOutputError
    tokenizer_info_from_file, tokenizer_info_from_tokenizer
    GrammarCompileService, PendingGrammar
    GrammarState, Phase
    BatchMasker, MaskRequest, StepMasks, apply_bitmask_inplace
    StructuredOutputManager (all of the above keyed by request id, for the engine loop)
"""

from .batch import (
    BatchMasker,
    MaskRequest,
    StepMasks,
    apply_bitmask_inplace,
    apply_bitmask_torch,
    bitmask_words,
    unpack_bitmask,
)
from .compiler import GrammarCompileService, PendingGrammar
from .errors import StructuredOutputError
from .grammar_state import GrammarState, Phase
from .manager import StructuredOutputManager
from .regex_audit import audit_regex
from .schema_audit import ENFORCED_FORMATS, audit_json_schema
from .so_args import SCHEMA_TYPES, StructuredOutputRequest, parse_so_args
from .tokenizer_info import tokenizer_info_from_file, tokenizer_info_from_tokenizer

__version__ = "0.1.0"

__all__ = [
    "ENFORCED_FORMATS",
    "SCHEMA_TYPES",
    "BatchMasker",
    "GrammarCompileService",
    "GrammarState",
    "MaskRequest",
    "PendingGrammar",
    "Phase",
    "StepMasks",
    "StructuredOutputError",
    "StructuredOutputManager",
    "StructuredOutputRequest",
    "apply_bitmask_inplace",
    "apply_bitmask_torch",
    "audit_json_schema",
    "audit_regex",
    "bitmask_words",
    "parse_so_args",
    "tokenizer_info_from_file",
    "tokenizer_info_from_tokenizer",
    "unpack_bitmask",
]

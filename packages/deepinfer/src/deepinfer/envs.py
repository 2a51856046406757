"""The engine's environment variables: `deepinfer.envs.DEEPINFER_HF_MODEL_DIR` and friends.

They are declared, typed and documented once, in `deepinfer_cluster.envs` (the leaf package every other
package reads its settings through); this module is that registry under the engine's name. Values are
read when accessed, so tests and callers may change the environment at any time.
"""

from __future__ import annotations

from typing import Any

from deepinfer_cluster.envs import (
    DP_ROUTING_POLICIES,
    KNOWN_NAMES,
    VARS,
    EnvVar,
    get,
    is_set,
    markdown_table,
    parse_token_ranges,
    warn_unknown,
)

__all__ = [
    "DP_ROUTING_POLICIES",
    "KNOWN_NAMES",
    "VARS",
    "EnvVar",
    "get",
    "is_set",
    "markdown_table",
    "parse_token_ranges",
    "warn_unknown",
]


def __getattr__(name: str) -> Any:
    if name in VARS:
        return get(name)
    raise AttributeError(name)

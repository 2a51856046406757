"""Op registry: one name per kernel-level operation, one implementation per backend.

```python
from deepinfer_model.ops import get_ops
ops = get_ops()                 # backend from DEEPINFER_ACCELERATOR / the build; see resolve_backend
y = ops.rms_norm(x, w, 1e-6)
ops.sources                     # {"rms_norm": "nvidia", "kv_store_fp8": "cpu", ...}
```
"""

from .kv_format import BYTES_PER_TOKEN, pack_fp8_tokens, store_fp8_tokens, unpack_fp8_tokens
from .registry import BACKENDS, OP_SPECS, OpTable, get_ops, register, resolve_backend

__all__ = [
    "BACKENDS",
    "BYTES_PER_TOKEN",
    "OP_SPECS",
    "OpTable",
    "get_ops",
    "pack_fp8_tokens",
    "register",
    "resolve_backend",
    "store_fp8_tokens",
    "unpack_fp8_tokens",
]

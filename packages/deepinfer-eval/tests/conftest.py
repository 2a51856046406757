"""Test helpers (eval_common) live beside this file; importlib mode does not put this directory on sys.path
by itself."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

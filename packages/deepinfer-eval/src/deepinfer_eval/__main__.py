"""`python -m deepinfer_eval`: the `deepinfer-eval` command, which `deepinfer eval` runs."""

import sys

from deepinfer_eval.cli import main

sys.exit(main())

"""Write the medium V4.1 checkpoint (`medium_v41.py`) with random quantised weights: `python make_medium_checkpoint.py DIR`.

Run in the background on the GPU machine at the start of a device call (weights drawn and quantised on the
GPU; 157 s on 16 CPU cores).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from medium_v41 import medium_v41_config_dict  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("path", type=Path)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--expert-width", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where weights are drawn"
    )
    args = ap.parse_args()
    from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint

    torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    cfg = medium_v41_config_dict(args.hidden, args.experts, args.expert_width)
    make_v41_checkpoint(args.path, cfg, seed=0, device=args.device)
    size = sum(f.stat().st_size for f in args.path.iterdir())
    print(
        f"medium checkpoint: {size / 1e9:.2f} GB in {time.monotonic() - t0:.0f} s at {args.path}", flush=True
    )


if __name__ == "__main__":
    main()

"""Write the default tiny V4.1 (random weights, seed 0) with a long context: `python make_long_tiny_checkpoint.py DIR`.

The built-in `deepinfer-tiny` has a 256-token context, so on a GPU the decode-PPL workloads run there at
their CPU size (`short.cpu_size`, `long_context.cpu_size`). This checkpoint is the same §11 config (the
real tokenizer's vocabulary, every layer kind) with `max_position_embeddings` large enough for the
full-size `long_context` workload (16,389 prompt + 4,096 output tokens, plus the draft tokens of nextn 5)
and the YaRN factor raised so that original_max_position_embeddings * factor = max_position_embeddings,
as in a real long-context config. Point `DEEPINFER_HF_MODEL_DIR` at it to get the full-size workloads
(`run_multi_gpu_suite.sh ppl`). Writes in a few seconds on a CPU (the weights are those of the tiny model).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path


def long_tiny_config(max_position_embeddings: int) -> dict:
    from deepinfer.default_model import tiny_config

    config = tiny_config()
    text = config["text_config"]
    rope = text["rope_scaling"]
    original = int(rope["original_max_position_embeddings"])
    if max_position_embeddings < original or max_position_embeddings % original:
        raise ValueError(
            f"max_position_embeddings must be a multiple of the YaRN original_max_position_embeddings "
            f"({original}) and >= it, got {max_position_embeddings}"
        )
    text["max_position_embeddings"] = max_position_embeddings
    rope["factor"] = float(max_position_embeddings // original)
    return config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path, help="directory to write (created)")
    ap.add_argument(
        "--max-position-embeddings",
        type=int,
        default=32_768,
        help="context length (default 32768: 16,389 + 4,096 + nextn slack fits)",
    )
    ap.add_argument("--seed", type=int, default=0, help="weight seed (0: the weights of deepinfer-tiny)")
    args = ap.parse_args()
    from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint

    if args.path.exists() and any(args.path.iterdir()):
        ap.error(f"path: {args.path} exists and is not empty")
    t0 = time.monotonic()
    config = long_tiny_config(args.max_position_embeddings)
    tmp = args.path.with_name(f".{args.path.name}.tmp")  # the directory appears only once complete
    shutil.rmtree(tmp, ignore_errors=True)  # a run killed half-way
    make_v41_checkpoint(tmp, config, seed=args.seed, tokenizer=True)
    tmp.replace(args.path)
    text = json.loads((args.path / "config.json").read_text())["text_config"]
    print(
        f"long tiny checkpoint: max_position_embeddings {text['max_position_embeddings']}, "
        f"YaRN factor {text['rope_scaling']['factor']:g}, in {time.monotonic() - t0:.1f} s at {args.path}",
        flush=True,
    )


if __name__ == "__main__":
    main()

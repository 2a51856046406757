"""The `deepinfer` argument parser. Only argparse, pathlib and the dataclass of engine arguments load
here, so that `--help`, `--version` and usage errors answer without importing torch."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..engine_args import EngineArgs
from .version import VersionAction

INPUT_FORMAT = (
    'Each line of --input is a JSON object: {"prompt": str}, {"prompt_token_ids": [int, ...]} or '
    '{"messages": [{"role": ..., "content": ...}, ...]} (content may be a list of OpenAI-style "text" and '
    '"image_url" parts), optionally with "images" (image paths or data: URLs for the prompt\'s <image> '
    'placeholders, or the image placeholder ids of prompt_token_ids, in order), "id" (a string or number '
    'naming the request in the output and in error messages; unique) and "sampling_params" (an object of '
    "SamplingParams fields that override the flags for that line). A bad line is refused alone, with "
    "its line number; the others run."
)
OUTPUT_HELP = (
    "append one JSON result per request here as each finishes (flushed), so Ctrl-C keeps the finished "
    "ones. Resume: if the file exists, requests it already holds without an error (matched by their "
    '"id", else by their position in the input) are skipped, so rerunning the same command finishes '
    "an interrupted run. Checked (parent directory exists, writable) before the model loads."
)


class Parser(argparse.ArgumentParser):
    """Usage errors in one line that points at --help, instead of the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--debug",
        action="store_true",
        help="print the traceback of an error instead of one line (also: DEEPINFER_DEBUG=1)",
    )


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "sampling (SamplingParams fields: the defaults of every request; an input line's "
        '"sampling_params" overrides them)'
    )
    g.add_argument(
        "--max-tokens", type=int, default=16, help="tokens to generate per sample (default: %(default)s)"
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 means greedy (argmax). The command defaults to greedy (0) so that a run repeats "
        "exactly; the Python API's SamplingParams defaults to 1.0 (default: %(default)s)",
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: keep the smallest set of tokens whose probability reaches this, "
        "in (0, 1]; 1 keeps all (default: %(default)s)",
    )
    g.add_argument(
        "--top-k",
        type=int,
        default=-1,
        help="keep only the k most likely tokens; -1 keeps all (default: %(default)s)",
    )
    g.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens less likely than this times the most likely one, in [0, 1]; 0 keeps all "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--n",
        type=int,
        default=1,
        help="completions per prompt; sample i uses seed seq_seed + i (default: %(default)s)",
    )
    g.add_argument(
        "--seq-seed",
        type=int,
        default=None,
        help="per-request random seed (SamplingParams.seq_seed, vLLM's `seed`; --seed is the engine's, as "
        "in vLLM): each draw is a pure function of (seed, position), whatever else runs in the batch "
        "(default: derived from the engine's --seed)",
    )
    g.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtracted once from the logit of each token already in the output, in [-2, 2]; 0 is off "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtracted from a token's logit per occurrence in the output, in [-2, 2]; 0 is off "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="tokens of the prompt and output: a positive logit divided by it, any other multiplied, in "
        "[0.01, 100]; 1 is off (default: %(default)s)",
    )
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    g.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="show (and write) each chosen token's log-probability and this many top alternatives "
        "(default: none)",
    )
    so = g.add_mutually_exclusive_group()
    so.add_argument(
        "--json-schema",
        metavar="FILE|JSON",
        help="constrain every completion to this JSON schema (a file, or the schema text itself)",
    )
    so.add_argument("--regex", metavar="REGEX", help="constrain every completion to match this regex")
    so.add_argument(
        "--grammar",
        metavar="FILE|EBNF",
        help="constrain every completion to this EBNF grammar (a file, or the grammar text itself)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="deepinfer", description="DeepInfer: offline inference for DeepSeek-V4.1-class MoE models."
    )
    parser.add_argument("--version", action=VersionAction)
    add_debug_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="generate text for prompts",
        description="Generate completions for --prompt strings or a JSONL file of requests. " + INPUT_FORMAT,
    )
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--input", type=Path, help="JSONL file of requests (format above)")
    gen.add_argument(
        "--image",
        action="append",
        metavar="PATH",
        help="an image file for the <image> placeholders of every --prompt, in order (repeatable; needs a "
        "model with a vision tower)",
    )
    gen.add_argument("--output", type=Path, help=OUTPUT_HELP)
    gen.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_debug_flag(gen)
    add_sampling_flags(gen)
    EngineArgs.add_cli_args(gen)

    bench = sub.add_parser(
        "bench",
        help="benchmarks: [throughput] | prefill | decode | sweep",
        description="Offline throughput (sync vs async loop). `deepinfer bench prefill|decode|sweep --help`: "
        "Pareto sweeps (deepinfer.bench.harness).",
    )
    from ..bench.throughput import add_bench_args

    add_bench_args(bench)
    add_debug_flag(bench)
    EngineArgs.add_cli_args(bench)

    sub.add_parser("serve", help="OpenAI-compatible HTTP server (deepinfer.serve)", add_help=False)
    sub.add_parser("run-batch", help="OpenAI batch file in, results out (deepinfer.batch)", add_help=False)
    sub.add_parser("launch", help="multi-process launch (deepinfer_cluster.launch)", add_help=False)
    sub.add_parser(
        "eval", help="AIME / HLE / GPQA evaluation (runs the deepinfer-eval command)", add_help=False
    )
    return parser

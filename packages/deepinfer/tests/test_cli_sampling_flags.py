"""The sampling flags of `deepinfer generate` become every request's SamplingParams (penalties included),
an input line's "sampling_params" override them, and a line's `seed` (vLLM's name of `seq_seed`) replaces
the --seq-seed default instead of clashing with it. In-process: argument parsing and the input file only,
no model."""

import json

import pytest
from deepinfer.cli.generate import sampling_defaults
from deepinfer.cli.input_file import read_requests
from deepinfer.cli.parser import build_parser


def defaults_of(*flags: str) -> dict:
    return sampling_defaults(build_parser().parse_args(["generate", "--prompt", "x", *flags]))


def test_penalty_flags_reach_each_request():
    defaults = defaults_of(
        "--presence-penalty", "0.5", "--frequency-penalty", "-1.25", "--repetition-penalty", "1.3"
    )  # fmt: skip
    (req,) = read_requests(["hello"], None, defaults)
    assert req.error is None
    p = req.params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.25, 1.3)
    assert p.reads_seen_tokens
    plain = read_requests(["hello"], None, defaults_of())[0].params
    assert (plain.presence_penalty, plain.frequency_penalty, plain.repetition_penalty) == (0.0, 0.0, 1.0)
    assert not plain.reads_seen_tokens


def test_a_lines_sampling_params_override_the_penalty_flags(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "x", "sampling_params": {"repetition_penalty": 2.0}}) + "\n")
    (req,) = read_requests(None, src, defaults_of("--repetition-penalty", "1.3", "--presence-penalty", "1"))
    assert req.params.repetition_penalty == 2.0 and req.params.presence_penalty == 1.0


@pytest.mark.parametrize(
    "line_params, seq_seed",
    [
        ({}, 7),  # the flag's
        ({"seed": 11}, 11),  # vLLM's name on the line replaces the flag's default
        ({"seq_seed": 12}, 12),
        ({"seed": 13, "seq_seed": 13}, 13),
    ],
)
def test_a_lines_seed_replaces_the_seq_seed_flag(tmp_path, line_params, seq_seed):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "x", "sampling_params": line_params}) + "\n")
    (req,) = read_requests(None, src, defaults_of("--seq-seed", "7"))
    assert req.error is None
    assert req.params.seq_seed == req.params.seed == seq_seed


def test_a_line_with_two_different_seeds_is_refused_alone(tmp_path):
    src = tmp_path / "in.jsonl"
    lines = [{"prompt": "x", "sampling_params": {"seed": 1, "seq_seed": 2}}, {"prompt": "y"}]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    bad, good = read_requests(None, src, defaults_of("--seq-seed", "7"))
    assert bad.error.startswith("sampling_params: seed is an alias of seq_seed")
    assert good.error is None and good.params.seq_seed == 7

"""`deepinfer bench` modes parse, and bad harness input fails with a message naming the field."""

import pytest
from deepinfer.bench.harness import build_parser
from deepinfer.bench.phases import DecodeConfig, PrefillConfig, run_decode, run_prefill
from deepinfer.cli import main


@pytest.mark.parametrize("mode", ["prefill", "decode", "sweep", "throughput"])
def test_every_bench_mode_has_help(mode, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", mode, "--help"])
    assert e.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_harness_parses_lists_and_engine_flags():
    args = build_parser().parse_args(["sweep", "--chunks", "8,16", "--batches", "1,4", "--num-threads", "1"])
    assert (args.chunks, args.batches, args.num_threads, args.accounting) == ([8, 16], [1, 4], 1, "full")


@pytest.mark.parametrize(
    "argv", [["prefill", "--chunks", "0,8"], ["decode", "--batches", "a"], ["sweep", "--accounting", "x"]]
)
def test_bad_lists_are_rejected_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert "--" in capsys.readouterr().err


def test_bad_phase_configs_name_the_field():
    # the checks run before any engine call, so no engine is needed
    with pytest.raises(ValueError, match="chunks"):
        run_prefill(None, PrefillConfig(chunks=[0]), None)
    with pytest.raises(ValueError, match="repeats"):
        run_prefill(None, PrefillConfig(chunks=[8], repeats=0), None)
    with pytest.raises(ValueError, match="batches"):
        run_decode(None, DecodeConfig(batches=[-1]), None)
    with pytest.raises(ValueError, match="measure_steps"):
        run_decode(None, DecodeConfig(batches=[1], measure_steps=0), None)

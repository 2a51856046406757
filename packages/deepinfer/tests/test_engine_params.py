"""SamplingParams / EngineArgs validation and the envs module."""

import argparse
import warnings

import pytest
from deepinfer import envs
from deepinfer.engine_args import EngineArgs
from deepinfer.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 0),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 2.0),
        ("top_k", 0),
        ("top_k", -5),
        ("min_p", 1.1),
        ("max_tokens", -3),
        ("max_tokens", 0),  # vLLM refuses it (the reference turned it into 1)
        ("temperature", 1e-300),
        ("temperature", float("inf")),
        ("temperature", 1e308),
        ("temperature", float("nan")),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("logit_bias", {5: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", [5, 1.0]),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [3, -2]),
        ("allowed_token_ids", [2**31]),
        ("bad_words", [""]),
        ("bad_words", ["ok", 3]),
        ("seed", 1.5),
        ("min_tokens", -1),
        ("logprobs", 1001),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("first_n_token_no_eos", 2),
        ("seq_seed", 1.5),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", 1001),
    ],
)
def test_sampling_params_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_normalisation():
    p = SamplingParams(max_tokens=1, stop="END", seq_seed=-1, top_logprobs=3)
    assert p.max_tokens == 1
    assert p.stop == ["END"]
    assert p.seq_seed == 2**64 - 1
    assert p.logprobs == 3
    assert SamplingParams(logprobs=True).logprobs == 0
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_sampling_params_vllm_fields():
    """seed is seq_seed's alias; logit_bias keys may be JSON's strings; the error ranges are named."""
    assert SamplingParams(seed=-1).seq_seed == 2**64 - 1
    assert SamplingParams(seed=7, seq_seed=7).seq_seed == 7
    assert SamplingParams(seq_seed=7).seed == 7
    assert SamplingParams(seed=True).seq_seed == 1  # a bool is an int, as seq_seed takes it
    with pytest.raises(ValueError, match="seed is an alias of seq_seed"):
        SamplingParams(seed=1, seq_seed=2)
    assert SamplingParams(logit_bias={"12": 1.5, 3: -2}).logit_bias == {3: -2.0, 12: 1.5}
    assert SamplingParams(bad_words="no").bad_words == ["no"]
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or in \[1e-05, 100000\]"):
        SamplingParams(temperature=1e-6)
    with pytest.raises(ValueError, match=r"presence_penalty must be in \[-2, 2\]"):
        SamplingParams(presence_penalty=-2.01)
    with pytest.raises(ValueError, match=r"repetition_penalty must be in \[0.01, 100\]"):
        SamplingParams(repetition_penalty=float("inf"))
    with pytest.raises(ValueError, match=r"logit_bias values must be in \[-100, 100\]"):
        SamplingParams(logit_bias={1: float("nan")})
    for edge in (0.0, 1e-5, 1e5):
        assert SamplingParams(temperature=edge).temperature == edge


def test_vocab_fields_checked_against_the_model():
    from deepinfer.sampling_params import validate_vocab_fields

    validate_vocab_fields(SamplingParams(logit_bias={511: 1.0}, allowed_token_ids=[0, 511]), 512)
    for field, value in [("logit_bias", {512: 1.0}), ("allowed_token_ids", [1, 600])]:
        with pytest.raises(ValueError, match=rf"{field} must hold token ids in \[0, 512\)"):
            validate_vocab_fields(SamplingParams(**{field: value}), 512)


def test_engine_args_cli_round_trip():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(
        parser.parse_args(["--max-num-seqs", "4", "--no-async-scheduling", "--seed", "7"])
    )
    assert (args.max_num_seqs, args.async_scheduling, args.seed) == (4, False, 7)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineArgs(max_num_seqs=0)
    with pytest.raises(ValueError, match="load_format"):
        EngineArgs(load_format="pt")


def test_envs_typed_and_unknown_warned(monkeypatch):
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", "/some/where")
    monkeypatch.setenv("DEEPINFER_LOGGING_INTERVAL_STEP", "5")
    monkeypatch.setenv("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", "0")
    assert envs.DEEPINFER_HF_MODEL_DIR == "/some/where"
    assert envs.DEEPINFER_LOGGING_INTERVAL_STEP == 5
    assert EngineArgs().model == "/some/where"
    assert EngineArgs(async_scheduling=True).use_async is False
    monkeypatch.setenv("DEEPINFER_LOGGING_INTERVAL_STEP", "five")
    with pytest.raises(ValueError, match="DEEPINFER_LOGGING_INTERVAL_STEP"):
        _ = envs.DEEPINFER_LOGGING_INTERVAL_STEP
    monkeypatch.setenv("DEEPINFER_TYPO_VARIABLE", "1")
    monkeypatch.setenv("DEEPINFER_GLOO_TIMEOUT", "10")  # a recognised reference knob: no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert envs.warn_unknown() == ["DEEPINFER_TYPO_VARIABLE"]
    assert any("DEEPINFER_TYPO_VARIABLE" in str(w.message) for w in caught)


def test_cudagraph_compile_backend_named_or_rejected(monkeypatch):
    """DEEPINFER_CUDAGRAPH_COMPILE: off by default and for none; a torch.compile backend of
    runtime/compiled.py is passed on; anything else is an error naming the variable and the choices."""
    from deepinfer_model.runtime import decode_graph_settings

    assert envs.DEEPINFER_CUDAGRAPH_COMPILE is None
    monkeypatch.setenv("DEEPINFER_CUDAGRAPH_COMPILE", "none")
    assert envs.DEEPINFER_CUDAGRAPH_COMPILE is None
    monkeypatch.setenv("DEEPINFER_CUDAGRAPH_COMPILE", "inductor")
    assert envs.DEEPINFER_CUDAGRAPH_COMPILE == "inductor"
    settings = decode_graph_settings("cuda", 4, 64, compile=envs.DEEPINFER_CUDAGRAPH_COMPILE)
    assert settings.compile == "inductor"
    monkeypatch.setenv("DEEPINFER_CUDAGRAPH_COMPILE", "tensorrt")
    with pytest.raises(ValueError, match="DEEPINFER_CUDAGRAPH_COMPILE must be none or one of inductor"):
        _ = envs.DEEPINFER_CUDAGRAPH_COMPILE


def test_token_blacklist_syntax():
    assert envs.parse_token_ranges("1..3,7, 9..9") == [1, 2, 3, 7, 9]
    with pytest.raises(ValueError, match="BLACKLIST"):
        envs.parse_token_ranges("5,3")


def test_reference_engine_knobs_accepted_or_rejected_by_name():
    args = EngineArgs(
        served_model_name="x", trust_remote_code=True, gpu_memory_utilization=0.5, data_parallel_size=1
    )
    assert args.gpu_memory_utilization == 0.5
    # (expert_parallel_size alone is accepted: data_parallel_size is derived from it, as the reference does)
    for field, value, others in [
        ("expert_parallel_size", 8, {"data_parallel_size": 1}),
        ("context_parallel_size", 2, {"runner": "recompute"}),  # context parallel splits paged steps
        ("engine_type", "decode", {}),
        ("gpu_memory_utilization", 1.5, {}),
    ]:
        with pytest.raises(ValueError, match=field):
            EngineArgs(**{field: value, **others})

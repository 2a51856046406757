"""`EngineArgs.device` / `--device` / `DEEPINFER_DEVICE`: validation, resolution, and (on a GPU machine)
the same tokens from the engine on CUDA as on the CPU."""

import argparse

import pytest
import torch
from deepinfer import LLM, EngineArgs, SamplingParams

PROMPTS = [[0, 40, 77, 91, 12, 300, 5], [0, 7, 7, 8, 9], [0, 450, 33, 98, 140, 21, 66, 71, 250]]


def test_device_defaults_to_env_then_auto(monkeypatch):
    monkeypatch.delenv("DEEPINFER_DEVICE", raising=False)
    args = EngineArgs()
    assert args.device == "auto"
    assert args.torch_device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("DEEPINFER_DEVICE", "cpu")
    assert EngineArgs().torch_device == torch.device("cpu")
    assert EngineArgs(device="auto").device == "auto"  # an explicit value beats the env var


def test_bad_device_names_the_field_and_the_allowed_values(monkeypatch):
    with pytest.raises(ValueError, match=r"device must be one of auto, cpu, cuda or cuda:N, got 'tpu'"):
        EngineArgs(device="tpu")
    monkeypatch.setenv("DEEPINFER_DEVICE", "gpu0")
    with pytest.raises(ValueError, match=r"device must be one of auto, cpu, cuda or cuda:N, got 'gpu0'"):
        EngineArgs()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"device = 'cuda' but CUDA is not available.*use device = cpu or auto"
    ):
        EngineArgs(device="cuda")


def test_cli_flag():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--device", "cpu"]))
    assert args.device == "cpu" and args.torch_device == torch.device("cpu")


def test_engine_places_model_and_cache_on_the_device(micro_checkpoint):
    with LLM(model=str(micro_checkpoint), device="cpu", block_size=16, max_model_len=64) as llm:
        eng = llm.engine
        assert eng.model.device == torch.device("cpu")
        assert all(p.device == torch.device("cpu") for p in eng.runner.cache.pools.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_cuda_engine_gives_the_cpu_tokens(micro_checkpoint, async_scheduling):
    """Greedy and seeded sampling: the same tokens on CUDA as on the CPU (logits agree to ~1e-7; a
    seeded draw could only differ where u lands that close to a CDF boundary)."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True, seq_seed=11),
    ]
    outs = {}
    for device in ("cpu", "cuda"):
        kw = dict(device=device, async_scheduling=async_scheduling, block_size=16, max_model_len=256)
        with LLM(model=str(micro_checkpoint), **kw) as llm:
            assert llm.engine.model.device.type == device
            outs[device] = [
                [
                    o.outputs[0].token_ids
                    for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=p, use_tqdm=False)
                ]
                for p in params
            ]
    assert outs["cuda"] == outs["cpu"]

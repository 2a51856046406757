"""End to end on the V4.1 architecture: the built-in deepinfer-tiny default model and the §11 tiny config."""

import threading

import torch
from deepinfer import LLM, SamplingParams
from deepinfer.cli import main
from deepinfer.default_model import RANDOM_WEIGHTS_NOTICE, TINY_NAME, ensure_tiny_model
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint


def test_default_model_generated_once_under_lock_and_cli_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(ensure_tiny_model())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(paths) == 2 and paths[0] == paths[1] and paths[0].name.startswith(TINY_NAME)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no half-written leftovers
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (paths[0] / name).exists()

    code = main(["generate", "--prompt", "Hello", "--max-tokens", "2", "--no-progress"])
    assert code == 0
    captured = capsys.readouterr()
    assert "RANDOM" in captured.err and RANDOM_WEIGHTS_NOTICE.split(":")[0] in captured.err
    assert "output tokens/s" in captured.err  # the summary table


def test_v41_tiny_config_generation_matches_naive_greedy_loop(tmp_path):
    path = make_v41_checkpoint(tmp_path / "v41-tiny", seed=0)  # the §11 config (vocab 256)
    with LLM(model=str(path), block_size=16) as llm:
        prompt = [0, 17, 99, 4, 250, 61, 8, 130]
        out = llm.generate(
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
            use_tqdm=False,
        )[0]
        assert out.error is None
        ids, ref = list(prompt), []
        for _ in range(3):
            ref.append(int(torch.argmax(llm.engine.model.forward(torch.tensor(ids)).logits[-1])))
            ids.append(ref[-1])
        assert out.outputs[0].token_ids == ref

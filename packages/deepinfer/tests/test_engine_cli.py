"""The `deepinfer` CLI: --help everywhere, and generate on a prompts file writes valid JSONL."""

import json

import pytest
from deepinfer.cli import main


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["generate", "--help"], ["bench", "--help"], ["launch", "--help"], ["eval", "--help"]],
)
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_generate_jsonl_round_trip(real_vocab_checkpoint, tmp_path, capsys):
    src = tmp_path / "prompts.jsonl"
    lines = [
        {"id": "a", "prompt": "The capital of France is a city called"},
        {"id": "b", "prompt_token_ids": [0, 5, 6, 7, 8, 9, 10, 11, 12], "sampling_params": {"max_tokens": 2}},
        {"id": "c", "messages": [{"role": "user", "content": "Tell me something about the sea"}]},
        {"id": "bad", "prompt": "A perfectly fine prompt of a good length", "sampling_params": {"top_k": 0}},
    ]
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    dst = tmp_path / "out.jsonl"
    code = main(
        [
            "generate",
            "--input",
            str(src),
            "--output",
            str(dst),
            "--model",
            str(real_vocab_checkpoint),
            "--max-tokens",
            "3",
            "--no-progress",
            "--block-size",
            "16",
            "--max-model-len",
            "128",
        ]
    )
    assert code == 1  # one request failed
    records = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", "b", "c", "bad"]
    assert [len(r["outputs"][0]["token_ids"]) for r in records[:3]] == [3, 2, 3]
    assert all(r["error"] is None and isinstance(r["outputs"][0]["text"], str) for r in records[:3])
    assert records[3]["error"] and "top_k" in records[3]["error"] and records[3]["outputs"] == []
    assert records[0]["metrics"]["ttft_s"] >= 0
    assert "output tokens/s" in capsys.readouterr().err

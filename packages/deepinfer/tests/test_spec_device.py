"""Speculative decoding (DSpark drafts, nextn > 0) is device-correct, proved without a GPU.

On a CPU-only machine a tensor factory without `device=` is invisible; on CUDA it fails ("Expected all
tensors to be on the same device") where its result meets the logits. The strict runs below execute
the whole engine — drafting, SpecDecodeState, the varlen rule, DraftVerifier, verify_logits, grammar
masks of draft rows — under `deepinfer_model.testing.strict_device()` (any factory call without an
explicit device raises, `torch.from_numpy` is disabled) and must give exactly the tokens of the plain
run: greedy (which also equals decoding with drafts off), seeded sampling, a JSON-schema request,
the oracle drafter, and the recompute runner's stateless drafter. A last test counts the verifier's
device-to-host synchronisations: one copy per verification step, not one per row or token.
"""

import json

import jsonschema
import pytest
import torch
from deepinfer import LLM, SamplingParams
from deepinfer.engine.drafting import OracleDrafter
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint
from deepinfer_model.testing import strict_device
from deepinfer_spec import DraftVerifier
from torch.overrides import TorchFunctionMode

PROMPTS = [[0, 17, 99, 4, 250, 61, 8, 130], [5, 6, 7, 8], [100, 3, 42]]
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def v41(tmp_path_factory, share_loaded_models):
    path = make_v41_checkpoint(tmp_path_factory.mktemp("v41-spec-device"), seed=0)
    return path


# Grammar bitmasks are filled by the CPU (xgrammar) in host buffers and sent to the logits' device by the
# structured / bitmask code (not the spec-decode path): their host factories are exempt.
HOST_BY_DESIGN = ("deepinfer_structured", "deepinfer_model.sampling.bitmask")


def _generate(path, params, nextn, monkeypatch, strict=False, drafter=None, runner="paged", prompts=None):
    """(token ids, logprobs, text) per request and the spec statistics; strict: generate under
    strict_device (grammar bitmask code exempt)."""
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", str(nextn))  # the root conftest pins it to 0
    with LLM(model=str(path), block_size=16, max_model_len=96, runner=runner) as llm:
        assert llm.engine.num_speculative_tokens == nextn
        if drafter is not None:
            llm.engine.spec.drafter = drafter(llm.engine.model)
        kw = dict(prompt_token_ids=PROMPTS) if prompts is None else dict(prompts=prompts)
        if strict:
            with strict_device(allow=HOST_BY_DESIGN):
                outs = llm.generate(sampling_params=params, use_tqdm=False, **kw)
        else:
            outs = llm.generate(sampling_params=params, use_tqdm=False, **kw)
        stats = llm.engine.spec_stats() if nextn else {}
    for o in outs:
        assert o.error is None, o.error
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].text) for o in outs], stats


GREEDY = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)


@pytest.mark.parametrize("nextn,runner", [(2, "paged"), (3, "paged"), (2, "recompute")])
def test_strict_greedy_with_drafts_equals_plain_greedy(v41, monkeypatch, nextn, runner):
    plain, _ = _generate(v41, GREEDY, 0, monkeypatch, runner=runner)
    spec, stats = _generate(v41, GREEDY, nextn, monkeypatch, strict=True, runner=runner)
    assert stats["verified"] > 0 and stats["nextn"] == nextn
    assert [t for t, *_ in spec] == [t for t, *_ in plain]


@pytest.mark.parametrize("nextn", [2, 3])
def test_strict_seeded_sampling_with_drafts_equals_the_plain_run(v41, monkeypatch, nextn):
    """Seeded sampling with drafts (rejection sampling, residual draws, drafter q rows, logprobs of the
    emitted tokens) gives bitwise the same tokens and logprobs under strict devices."""
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=7, ignore_eos=True, seq_seed=11, logprobs=2),
        SamplingParams(temperature=1.0, top_k=5, max_tokens=7, ignore_eos=True, seq_seed=12),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # greedy in the same batch
    ]
    plain, stats = _generate(v41, params, nextn, monkeypatch)
    strict, strict_stats = _generate(v41, params, nextn, monkeypatch, strict=True)
    assert stats["verified"] > 0
    assert strict == plain
    assert strict_stats["verified"] == stats["verified"] and strict_stats["accepted"] == stats["accepted"]
    assert plain[0][1] is not None and len(plain[0][1]) == len(plain[0][0])


def test_strict_oracle_drafter_accepts_and_equals_the_plain_run(v41, monkeypatch):
    """The oracle's drafts are the target's greedy continuation: all accepted under greedy decoding
    (the accept path), one-hot q rows under sampling (built on the model's device)."""
    params = [GREEDY, SamplingParams(temperature=0.7, max_tokens=7, ignore_eos=True, seq_seed=5), GREEDY]
    plain, stats = _generate(v41, params, 3, monkeypatch, drafter=OracleDrafter)
    strict, _ = _generate(v41, params, 3, monkeypatch, strict=True, drafter=OracleDrafter)
    assert stats["accepted"] > 0
    assert strict == plain


def test_strict_json_schema_with_drafts_equals_the_plain_run(v41, monkeypatch):
    """Grammar masks of draft rows and the matcher rollback under strict devices: greedy equals decoding
    without drafts, sampled equals the non-strict run, and every output satisfies the schema."""

    def so(seed, temperature):
        return SamplingParams(
            temperature=temperature,
            max_tokens=30,
            seq_seed=seed,
            so_args={"schema_type": "json_schema", "schema": SCHEMA, "max_whitespace": 1},
        )

    params = [so(0, 0.0), so(3, 1.0)]
    prompts = ["x", "x"]
    no_drafts, _ = _generate(v41, params, 0, monkeypatch, prompts=prompts)
    plain, stats = _generate(v41, params, 3, monkeypatch, prompts=prompts)
    strict, _ = _generate(v41, params, 3, monkeypatch, strict=True, prompts=prompts)
    assert stats["verified"] > 0
    assert strict == plain
    assert strict[0][0] == no_drafts[0][0]
    for _, _, text in strict:
        jsonschema.validate(json.loads(text), SCHEMA)


class HostSyncs(TorchFunctionMode):
    """Counts device-to-host synchronisations: `.cpu()` calls, and every read of a tensor's values on the
    host (item, tolist, bool, int, float, index, numpy) of a tensor that is not (a view of) the result
    of such a copy. On CUDA each of these stalls the host until the GPU catches up."""

    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"}

    def __init__(self):
        super().__init__()
        self.copies, self.reads, self.host = 0, [], set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name == "cpu":
            self.copies += 1
            self.host.add(out.untyped_storage().data_ptr())
        elif name in self.READS and isinstance(args[0], torch.Tensor):
            if args[0].untyped_storage().data_ptr() not in self.host:
                self.reads.append(name)
        return out


def test_verifier_is_strict_and_copies_to_the_host_once_per_step():
    """A mixed batch (greedy, sampled, a padded draft, forced golden rows, a request without drafts)
    verifies under strict devices with exactly one device-to-host copy and no other host read."""
    gen = torch.Generator().manual_seed(0)
    vocab, ks = 50, [3, 0, 2, 3, 1]
    greedy = [False, True, False, True, False]
    rows = sum(ks) + len(ks)
    with torch.device("cpu"):  # test data; the verifier itself runs under the strict mode
        target = torch.softmax(torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 3, -1)
        q = torch.softmax(torch.randn(sum(ks), vocab, generator=gen, dtype=torch.float64) * 3, -1)
        verify_rows = [d + i for i, k in enumerate(ks) for d in range(sum(ks[:i]), sum(ks[:i]) + k)]
        q = 0.2 * q + 0.8 * target[verify_rows]
        drafts = torch.multinomial(q, 1, generator=gen).squeeze(1).tolist()
    drafts[1] = -1  # padding: always rejected
    kwargs = dict(
        seeds=[3, 1, 4, 1, 5],
        base_positions=[10, 20, 30, 40, 50],
        greedy=greedy,
        draft_probs=q,
        golden=[None, [7], [-1, drafts[3]], None, [-1, 9]],
    )
    reference = DraftVerifier().verify(target, drafts, ks, **kwargs)
    with strict_device(), HostSyncs() as syncs:
        result = DraftVerifier().verify(target, drafts, ks, **kwargs)
    assert syncs.copies == 1 and syncs.reads == [], (syncs.copies, syncs.reads)
    assert result.emitted == reference.emitted and result.num_accepted == reference.num_accepted
    assert torch.equal(result.row_accepted, reference.row_accepted)
    assert torch.equal(result.accept_probs, reference.accept_probs)
    assert result.emitted[1] == [7]  # forced fresh row of the request without drafts
    # the detector itself: a per-row read of a device tensor is counted
    with HostSyncs() as syncs:
        [int(t) for t in target.argmax(-1)]
    assert len(syncs.reads) == rows

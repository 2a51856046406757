"""Bad sampling parameters raise a ValueError that names the field."""

import pytest
from deepinfer_model.sampling import MAX_LOGPROBS, RowParams


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", 0),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("logprobs", -1),
        ("logprobs", MAX_LOGPROBS + 1),
        ("position", -1),
    ],
)
def test_bad_field_is_named(field, value):
    with pytest.raises(ValueError, match=field):
        RowParams(**{field: value})


def test_seed_must_be_int():
    with pytest.raises(TypeError, match="seq_seed"):
        RowParams(seed=1.5)


def test_valid_edges_are_accepted():
    RowParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, logprobs=MAX_LOGPROBS)
    RowParams(top_k=1, top_p=1e-9, min_p=0.0, logprobs=0)

"""An independent float64 MoE (router top-k + SwiGLU experts + shared expert), written naively."""

from __future__ import annotations

import torch

H, INTER, E, TOPK = 16, 8, 8, 3


def make_weights(num_layers: int = 1, seed: int = 0, hot: tuple[int, ...] = ()) -> list[dict]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    layers = []
    for _ in range(num_layers):
        bias = torch.zeros(E, dtype=torch.float64)
        bias[list(hot)] = 4.0  # makes a few experts hot, so that EPLB has something to fix
        layers.append({
            "router": rnd(E, H, scale=H**-0.5), "bias": bias,
            "w1": rnd(E, INTER, H, scale=H**-0.5), "w3": rnd(E, INTER, H, scale=H**-0.5),
            "w2": rnd(E, H, INTER, scale=INTER**-0.5),
            "s1": rnd(INTER, H, scale=H**-0.5), "s3": rnd(INTER, H, scale=H**-0.5),
            "s2": rnd(H, INTER, scale=INTER**-0.5),
        })  # fmt: skip
    return layers


def swiglu(x, w1, w3, w2):
    return (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def route(x, layer):
    scores = torch.softmax(x @ layer["router"].T + layer["bias"], dim=-1)
    weights, ids = scores.topk(TOPK, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


def moe_reference(x, layer):
    """Token by token, choice by choice: the definition of the layer."""
    ids, weights = route(x, layer)
    out = swiglu(x, layer["s1"], layer["s3"], layer["s2"])
    for t in range(x.shape[0]):
        for j in range(TOPK):
            e = int(ids[t, j])
            out[t] += weights[t, j] * swiglu(x[t : t + 1], layer["w1"][e], layer["w3"][e], layer["w2"][e])[0]
    return out


def model_reference(x, layers):
    for layer in layers:
        x = x + moe_reference(x, layer)
    return x


def assert_close(actual, expected, tol: float = 1e-12):
    # torch.testing.assert_close would import torch.distributed.tensor in every worker (seconds each).
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert err <= tol * (1 + expected.abs().max().item() if expected.numel() else 1), f"max abs error {err}"

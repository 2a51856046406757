"""The workspace's one random stream against an independent reference: a naive, stateful SplitMix64
generator written here from its definition, anchored to the generator's published outputs."""

import random
from fractions import Fraction

from deepinfer_spec import Purpose, stream_bits, stream_uniform, stream_uniforms

TWO_64 = 2**64


class SplitMix64:
    """SplitMix64 as usually stated: a Weyl sequence (add the golden gamma), then a mixing step."""

    GAMMA = 0x9E3779B97F4A7C15

    def __init__(self, seed: int):
        self.state = seed % TWO_64

    def advance(self, steps: int) -> "SplitMix64":
        self.state = (self.state + steps * self.GAMMA) % TWO_64
        return self

    def next(self) -> int:
        self.advance(1)
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % TWO_64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % TWO_64
        return z ^ (z >> 31)


def reference_bits(seed: int, position: int, purpose: int) -> int:
    """Output number 3 * position + purpose (0-based) of the generator seeded with `seed`, used as the
    seed offset of a second generator whose first output is the draw."""
    first = SplitMix64(seed).advance(3 * position + purpose).next()
    return SplitMix64(first + seed).next()


def test_the_reference_generator_gives_splitmix64s_published_outputs():
    gen = SplitMix64(1234567)
    assert [gen.next() for _ in range(5)] == [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
        4593380528125082431,
        16408922859458223821,
    ]


def test_advancing_the_reference_equals_stepping_it():
    for seed in (0, 1, 2**64 - 1, 987654321):
        stepped = SplitMix64(seed)
        outputs = [stepped.next() for _ in range(40)]
        assert [SplitMix64(seed).advance(n).next() for n in range(40)] == outputs


def test_stream_bits_equal_the_reference():
    rng = random.Random(5)
    cases = [(0, 0, 0), (123, 456, 1), (2**64 - 1, 10**12, 2), (7, 10_000_019 * 3 + 5, 0), (-5, 3, 1)]
    cases += [
        (rng.getrandbits(64), rng.getrandbits(rng.choice([4, 30, 62])), rng.randrange(3)) for _ in range(300)
    ]
    for seed, position, purpose in cases:
        assert stream_bits(seed, position, purpose) == reference_bits(seed, position, purpose)
        assert stream_bits(seed, position, Purpose(purpose)) == reference_bits(seed, position, purpose)


def test_small_positions_walk_one_generator_output_by_output():
    # Without `advance`: output k of one generator keys (position, purpose) = divmod(k, 3).
    for seed in (0, 42, 2**63 + 11):
        gen = SplitMix64(seed)
        for k in range(60):
            position, purpose = divmod(k, 3)
            assert stream_bits(seed, position, purpose) == SplitMix64(gen.next() + seed).next()


def test_stream_uniform_is_the_top_53_bits_over_two_to_the_53():
    rng = random.Random(9)
    for _ in range(300):
        seed, position, purpose = rng.getrandbits(64), rng.getrandbits(40), rng.randrange(3)
        expected = Fraction(reference_bits(seed, position, purpose) >> 11, 2**53)
        u = stream_uniform(seed, position, purpose)
        assert Fraction(u) == expected and 0.0 <= u < 1.0


def test_vectorised_stream_is_bit_identical_to_the_scalar_one():
    rng = random.Random(3)
    seeds = [rng.getrandbits(64) for _ in range(200)] + [0, 2**64 - 1, -5]
    positions = [rng.getrandbits(rng.choice([8, 40, 62])) for _ in range(203)]
    for purpose in Purpose:
        got = stream_uniforms(seeds, positions, purpose).tolist()
        assert got == [stream_uniform(s, p, purpose) for s, p in zip(seeds, positions)]


def test_the_tensor_stream_is_bitwise_the_host_stream():
    """Device-side draws (int64 tensor arithmetic) equal the numpy / Python ones, including seeds and
    positions past 2**63, negative seeds and every purpose."""
    import numpy as np
    import torch
    from deepinfer_spec import int64_bits, stream_uniforms_tensor

    rng = random.Random(11)
    seeds = [0, 1, -5, 2**63 - 1, 2**63, 2**64 - 1, 10**30] + [
        rng.randrange(-(2**70), 2**70) for _ in range(200)
    ]
    positions = [0, 1, 2**62, 2**63 - 1, 5, 10_000_019 * 5 + 3, 7] + [
        rng.randrange(0, 2**63) for _ in range(200)
    ]
    for purpose in Purpose:
        want = stream_uniforms(seeds, positions, purpose)
        got = stream_uniforms_tensor(
            torch.from_numpy(int64_bits(seeds)), torch.from_numpy(int64_bits(positions)), purpose
        )
        assert got.dtype == torch.float64
        assert np.array_equal(got.numpy(), want)
        assert [stream_uniform(s, p, purpose) for s, p in zip(seeds[:20], positions[:20])] == got[
            :20
        ].tolist()


def test_the_tensor_stream_takes_positions_computed_on_the_device():
    """A draft position base + accepted + step + 1 built from device tensors draws what the host does."""
    import torch
    from deepinfer_spec import DRAFT_SEED_OFFSET, draft_position, int64_bits, stream_uniforms_tensor

    seeds, base, accepted = [3, 2**64 - 2, 99], [10, 0, 12345], [0, 2, 5]
    dev_seeds = torch.from_numpy(int64_bits([s + DRAFT_SEED_OFFSET for s in seeds]))
    for step in range(4):
        pos = torch.tensor(base) + torch.tensor(accepted) + step + 1
        got = stream_uniforms_tensor(dev_seeds, pos, Purpose.SAMPLE).tolist()
        want = [
            stream_uniform(s + DRAFT_SEED_OFFSET, draft_position(b, a, step), Purpose.SAMPLE)
            for s, b, a in zip(seeds, base, accepted)
        ]
        assert got == want


def test_the_tensor_stream_wants_int64():
    import pytest
    import torch
    from deepinfer_spec import stream_uniforms_tensor

    with pytest.raises(ValueError, match="int64 tensors"):
        stream_uniforms_tensor(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))


def test_the_tensor_stream_takes_a_purpose_per_draw():
    import torch
    from deepinfer_spec import stream_uniforms_tensor

    seeds = torch.tensor([5, -7, 2**40, 3, 3, 3])
    positions = torch.tensor([0, 9, 123456, 7, 7, 7])
    purposes = torch.tensor([Purpose.ACCEPT, Purpose.SAMPLE, Purpose.RESIDUAL, 0, 1, 2])
    got = stream_uniforms_tensor(seeds, positions, purposes).tolist()
    assert got == [stream_uniform(int(s), int(p), int(u)) for s, p, u in zip(seeds, positions, purposes)]

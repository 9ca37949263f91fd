"""The batched seeded sampling noise (rollout/seeded_noise.py) and the sampler patch that uses it."""
from __future__ import annotations

import types

import pytest
import torch

from nla_grpo.rollout.seeded_noise import (OFFSET_STEP, exponential_noise_reference, generator_positions, seeded_noise_like)


def noise(seeds, positions, vocab):
    return exponential_noise_reference(torch.tensor(seeds, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                                       vocab)


def test_a_row_depends_on_its_own_seed_and_position_only():
    q = noise([5, 5, 6, 5, -3, 2 ** 40], [0, 4, 0, 0, 0, 0], 1000)
    assert q.dtype == torch.float32 and q.shape == (6, 1000) and bool((q > 0).all())
    assert torch.equal(q[0], q[3])  # same key, same row
    for a, b in [(0, 1), (0, 2), (0, 4), (0, 5), (1, 2)]:
        assert not torch.equal(q[a], q[b])
    alone = noise([6], [0], 1000)[0]
    assert torch.equal(alone, q[2])  # the batch around a row changes nothing
    assert torch.equal(noise([5], [0], 1000), noise([5], [0], 1000))


def test_the_noise_is_exponential_and_rows_are_uncorrelated():
    rows = 4096
    q = noise([11] * rows, [OFFSET_STEP * i for i in range(rows)], 64)
    flat = q.flatten().double()
    assert abs(flat.mean().item() - 1) < 0.01 and abs(flat.var().item() - 1) < 0.03
    # Kolmogorov-Smirnov distance to Exp(1) over 262k draws: ~0.003 for a good generator
    x, _ = flat.sort()
    cdf = 1 - torch.exp(-x)
    ecdf = torch.arange(1, len(x) + 1, dtype=torch.float64) / len(x)
    assert (cdf - ecdf).abs().max().item() < 0.01
    # one step to the next (what a sample sees token after token) and one seed to the next
    steps = torch.corrcoef(torch.stack([q[:-1].flatten(), q[1:].flatten()]))[0, 1].item()
    seeds = noise(list(range(rows)), [0] * rows, 64)
    across = torch.corrcoef(torch.stack([seeds[:-1].flatten(), seeds[1:].flatten()]))[0, 1].item()
    vocab = torch.corrcoef(torch.stack([q[:, :-1].flatten(), q[:, 1:].flatten()]))[0, 1].item()
    assert max(abs(steps), abs(across), abs(vocab)) < 0.01


@pytest.mark.parametrize("keys", ["steps", "seeds"])
def test_sampling_with_the_noise_draws_tokens_at_their_probabilities(keys):
    """argmax(p / q), the sampler's rule, over 20,000 keys: a chi-square test of the token counts."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.04, 0.01])
    n = 20_000
    seeds, positions = ([3] * n, [OFFSET_STEP * i for i in range(n)]) if keys == "steps" else (list(range(n)), [0] * n)
    tokens = (p / noise(seeds, positions, len(p))).argmax(dim=-1)
    counts = torch.bincount(tokens, minlength=len(p)).double()
    chi2 = ((counts - n * p.double()) ** 2 / (n * p.double())).sum().item()
    assert chi2 < 20.5  # chi-square, 5 degrees of freedom, p = 0.001


class FakeCudaGenerator:
    """What the noise reads from vLLM's CUDA request generators: the seed and the Philox offset."""

    device = types.SimpleNamespace(type="cuda")

    def __init__(self, seed):
        self.seed, self.offset = seed, 0

    def initial_seed(self):
        return self.seed

    def get_offset(self):
        return self.offset

    def set_offset(self, offset):
        self.offset = offset


def test_generator_positions_advance_like_vllm_and_a_rewind_draws_again():
    gens = {2: FakeCudaGenerator(7), 0: FakeCudaGenerator(2 ** 64 - 1)}
    rows, seeds, positions = generator_positions(gens)
    assert rows == [0, 2] and seeds == [-1, 7] and positions == [0, 0]
    assert gens[2].offset == OFFSET_STEP
    _, _, positions = generator_positions(gens)
    assert positions == [OFFSET_STEP, OFFSET_STEP]
    gens[2].set_offset(gens[2].get_offset() - OFFSET_STEP)  # vLLM discards a partial prefill's token
    _, _, again = generator_positions(gens)
    assert again == [2 * OFFSET_STEP, OFFSET_STEP]

    cpu = [torch.Generator().manual_seed(9) for _ in range(2)]
    first = [generator_positions({0: g})[2][0] for g in cpu]
    assert first[0] == first[1] and generator_positions({0: cpu[0]})[2][0] != first[0]  # a draw moves it


def test_seeded_rows_get_their_keys_noise_and_the_others_the_default_generator():
    probs = torch.softmax(torch.randn(4, 300, generator=torch.Generator().manual_seed(0)), dim=-1)
    gens = {3: torch.Generator().manual_seed(5), 1: torch.Generator().manual_seed(6)}
    twins = {3: torch.Generator().manual_seed(5), 1: torch.Generator().manual_seed(6)}
    _, seeds, positions = generator_positions(twins)
    torch.manual_seed(0)
    q = seeded_noise_like(probs, gens)
    assert torch.equal(q[[1, 3]], noise(seeds, positions, 300))
    torch.manual_seed(0)
    again = seeded_noise_like(probs, {3: torch.Generator().manual_seed(5), 1: torch.Generator().manual_seed(6)})
    assert torch.equal(q, again)  # unseeded rows follow the default generator, as vLLM draws them
    everyone = {i: torch.Generator().manual_seed(i) for i in range(4)}
    full = seeded_noise_like(probs, everyone)
    assert full.shape == probs.shape and torch.equal(full[2], seeded_noise_like(probs[:1], {0: torch.Generator().manual_seed(2)})[0])


def test_the_patch_replaces_only_vllms_loop_and_passes_everything_else_through():
    from nla_grpo.rollout.vllm.patches import batched_seeded_sampling

    calls = []

    def random_sample(probs, generators, use_fp64_gumbel=False):
        calls.append(len(generators))
        return probs.argmax(dim=-1)

    module = types.SimpleNamespace(random_sample=random_sample,
                                   sample_with_exponential_noise=lambda p, q: p.div_(q).argmax(dim=-1).view(-1))
    assert batched_seeded_sampling(module)
    assert not batched_seeded_sampling(module)  # once is enough
    probs = torch.softmax(torch.randn(3, 50), dim=-1)
    module.random_sample(probs, {0: torch.Generator().manual_seed(1)})  # CPU tensors: vLLM's own
    module.random_sample(probs, {})
    assert calls == [1, 0]
    assert not batched_seeded_sampling(types.SimpleNamespace(random_sample=lambda logits, k, p: None))
    assert not batched_seeded_sampling(types.SimpleNamespace())


def test_the_installed_vllm_sampler_takes_the_patch():
    """The contract with the installed vLLM: ``random_sample(probs, generators, ...)`` is where its sampler
    draws the seeded rows' noise, and the patched one still samples CPU tensors through vLLM's own."""
    from vllm.v1.sample.ops import topk_topp_sampler as module

    from nla_grpo.rollout.vllm.patches import batched_seeded_sampling

    original = module.random_sample
    try:
        assert batched_seeded_sampling() or getattr(original, "batched_seeds", False)
        probs = torch.softmax(torch.randn(2, 40), dim=-1)
        gens = {i: torch.Generator().manual_seed(i) for i in range(2)}
        twins = {i: torch.Generator().manual_seed(i) for i in range(2)}
        assert torch.equal(module.random_sample(probs.clone(), gens), original(probs.clone(), twins))
    finally:
        module.random_sample = original

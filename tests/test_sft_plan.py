"""The SFT stages' pure pieces: batches by tokens, the step count, the rate schedule, the loss share and
the response an explanation becomes."""
import math

import pytest
import torch

from nla_grpo.sft.plan import StepBatches, epoch_batches, lr_at, response_ids, response_text, token_nll_sum, total_steps


def test_an_epoch_sees_every_row_once_in_batches_of_at_least_the_budget():
    lengths = [5, 17, 3, 40, 9, 9, 12, 1, 30, 8] * 7
    batches = epoch_batches(lengths, 50, seed=3, epoch=0)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) >= 50 for b in batches[:-1])
    # a batch closes as soon as it holds the budget: without its last row it would not
    assert all(sum(lengths[i] for i in b[:-1]) < 50 for b in batches)
    assert epoch_batches(lengths, 50, seed=3, epoch=0) == batches
    assert epoch_batches(lengths, 50, seed=3, epoch=1) != batches
    assert epoch_batches(lengths, 50, seed=4, epoch=0) != batches


def test_steps_run_epoch_after_epoch_and_a_resumed_plan_is_the_same():
    lengths = list(range(1, 30))
    plan = StepBatches(lengths, 40, seed=1)
    n = plan.per_epoch
    steps = [plan.batch(s) for s in range(3 * n)]
    assert [e for e, _ in steps] == [0] * n + [1] * n + [2] * n
    assert sorted(i for _, b in steps[n:2 * n] for i in b) == list(range(len(lengths)))
    fresh = StepBatches(lengths, 40, seed=1)  # what a resumed run recomputes, asked from the middle
    assert fresh.batch(2 * n + 1) == steps[2 * n + 1]


def test_total_steps():
    assert total_steps(7, 3.0, 10) == 7
    assert total_steps(None, 1.5, 10) == 15
    assert total_steps(None, 0.01, 10) == 1


def test_warmup_then_cosine_to_a_tenth():
    total, peak = 100, 1e-3
    assert lr_at(0, total, peak, 10, "cosine") == pytest.approx(peak / 10)
    assert lr_at(9, total, peak, 10, "cosine") == pytest.approx(peak)
    assert lr_at(10, total, peak, 10, "cosine") == pytest.approx(peak)
    assert lr_at(total - 1, total, peak, 10, "cosine") == pytest.approx(peak / 10)
    rates = [lr_at(s, total, peak, 10, "cosine") for s in range(10, total)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))
    assert lr_at(55, total, peak, 0, "constant") == peak
    assert lr_at(0, total, peak, 0, "cosine") == peak


def test_token_nll_sum_counts_masked_tokens_only():
    logp = torch.tensor([[-1.0, -2.0, -7.0], [-0.5, -9.0, -9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    total, n = token_nll_sum(logp, mask)
    assert n == 3 and float(total) == pytest.approx(3.5)
    assert math.isclose(float(total) / n, 3.5 / 3)


class _Tok:
    """Characters as ids, as far as these tests need a tokenizer."""

    def encode(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            if text.startswith("</explanation>", i):
                out.append(1000)
                i += len("</explanation>")
            else:
                out.append(ord(text[i]))
                i += 1
        return out


def test_the_response_is_what_the_rollout_extracts_less_the_prefill():
    assert response_text(" sea waves ", "") == "<explanation>sea waves</explanation>"
    assert response_text("sea", "<explanation>") == "sea</explanation>"
    # ended at a stop id the text holds (an extra stop token), else by the first EOS id
    ids = response_ids(_Tok(), "ab", "<explanation>", [7, 1000])
    assert ids == [ord("a"), ord("b"), 1000]
    ids = response_ids(_Tok(), "ab", "<explanation>", [7])
    assert ids == [ord("a"), ord("b"), 1000, 7]

"""The SFT stages' pure pieces: batches by tokens, the step count, the learning-rate schedule, the
token-mean cross-entropy, and the response an explanation becomes.

Everything a step depends on is a function of (seed, step), so a resumed run recomputes the batch and
the rate of the step it continues with instead of saving a sampler's or a scheduler's state.
"""
from __future__ import annotations

import math

import numpy as np


def epoch_batches(lengths, batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """One pass over the rows in a seeded order, cut into batches of whole rows holding at least
    ``batch_tokens`` tokens each (a batch closes with the row that reaches the budget); the last, short
    batch of the pass is kept, so every row is seen once per epoch."""
    order = np.random.default_rng([int(seed), int(epoch)]).permutation(len(lengths))
    batches, current, tokens = [], [], 0
    for i in order.tolist():
        current.append(i)
        tokens += int(lengths[i])
        if tokens >= batch_tokens:
            batches.append(current)
            current, tokens = [], 0
    if current:
        batches.append(current)
    return batches


class StepBatches:
    """``batch(step)``: the rows of optimiser step ``step`` (0-based), epoch after epoch."""

    def __init__(self, lengths, batch_tokens: int, seed: int):
        if len(lengths) == 0:
            raise ValueError("no training rows")
        self.lengths, self.batch_tokens, self.seed = list(lengths), batch_tokens, seed
        self._epochs: list[list[list[int]]] = []

    def _epoch(self, e: int) -> list[list[int]]:
        while len(self._epochs) <= e:
            self._epochs.append(epoch_batches(self.lengths, self.batch_tokens, self.seed, len(self._epochs)))
        return self._epochs[e]

    @property
    def per_epoch(self) -> int:
        return len(self._epoch(0))

    def batch(self, step: int) -> tuple[int, list[int]]:
        """``(epoch, row indices)`` of step ``step``."""
        e = 0
        while step >= len(self._epoch(e)):
            step -= len(self._epoch(e))
            e += 1
        return e, self._epoch(e)[step]


def total_steps(steps: int | None, epochs: float, per_epoch: int) -> int:
    """``steps`` when set, else ``epochs`` passes of ``per_epoch`` batches (at least one step)."""
    return int(steps) if steps is not None else max(1, math.ceil(epochs * per_epoch))


def lr_at(step: int, total: int, peak: float, warmup: int, schedule: str) -> float:
    """The rate of optimiser step ``step`` (0-based) of ``total``: linear warm-up over ``warmup`` steps to
    ``peak`` (step 0 already takes a non-zero rate), then constant or cosine to ``peak / 10`` at the last."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    span = max(1, total - 1 - warmup)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    floor = peak / 10
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def token_nll_sum(logp, mask):
    """``(-Σ logp over masked tokens, masked token count)``: a micro-batch's share of the token-mean
    cross-entropy (the caller divides every share by the batch's token count, so gradients add up)."""
    m = mask.to(logp.dtype)
    return -(logp * m).sum(), int(mask.sum())


def response_text(explanation: str, prefill: str) -> str:
    """What the verbaliser should write for ``explanation``: the ``<explanation>`` form the rollout's
    extraction reads, less the prefill the prompt already ends with."""
    text = f"<explanation>{explanation.strip()}</explanation>"
    # a prefill that is not the tag's start: the model writes the whole answer after it
    return text[len(prefill):] if prefill and text.startswith(prefill) else text


def response_ids(tokenizer, explanation: str, prefill: str, stop_ids: list[int]) -> list[int]:
    """The explanation's response tokens, ended as a rollout ends: by a stop id the text already holds
    (an ``extra_stop_tokens`` entry such as ``</explanation>``), else by the first EOS id."""
    from nla_grpo.shared.prompts import as_ids

    ids = as_ids(tokenizer.encode(response_text(explanation, prefill), add_special_tokens=False))
    stops = set(stop_ids)
    cut = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
    return ids[:cut] if cut is not None else ids + [int(stop_ids[0])]

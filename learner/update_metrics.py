"""What one ``Learner.update`` reports: the loss terms summed over micro-batches and ranks, and what
the update cost in tokens and FLOPs.

FLOPs are counted two ways, both with N = the frozen base's parameters (4-bit weights at their full shape, the adapters
left out, attention's own FLOPs left out):

- ``learner/tflops_effective``: 6·N per *logical* token, every sample's prompt + response, as an
  unpacked trainer would run them (forward + backward of the policy and the reference forward, by the
  usual 6·N rule). A packed update skips most of that work, so this figure can exceed the GPU's peak.
- ``learner/tflops_executed``: per token the rows actually ran (a group's prompt once, no padding):
  2·N for the policy forward, 2·N for its backward (activation gradients only: the base is frozen, so
  no weight gradient), 2·N for the reference forward: 6·N; plus 2·N for the policy's rescoring pass
  when ``ppo_epochs > 1``. Divided by a GEMM peak measured on the same GPU, this is the MFU.

With ``grpo.kl_beta`` 0 there is no reference forward: 4·N per token in both counts.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

EXECUTED_FLOPS_PER_TOKEN = 6  # × N: policy forward 2, policy backward (activations only) 2, reference forward 2
REFERENCE_FLOPS_PER_TOKEN = 2  # × N: the reference forward, skipped when grpo.kl_beta is 0
RESCORE_FLOPS_PER_TOKEN = 2  # × N: the policy's logprobs recomputed before the first epoch (ppo_epochs > 1)
THROUGHPUT_KEYS = ("learner/tokens_per_s", "learner/tflops_effective", "learner/tflops_executed",
                   "learner/executed_tokens")


def base_parameter_count(model) -> int:
    """Parameters of the frozen base (the adapters left out; a 4-bit weight counted at its full shape)."""
    n = 0
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        shape = getattr(getattr(p, "quant_state", None), "shape", None)
        n += math.prod(shape) if shape is not None else p.numel()
    return n


def executed_tokens(batch) -> int:
    """Tokens a micro-batch's forward really processes: a packed batch's rows without their padding, a
    padded batch's real tokens (its attention mask)."""
    processed = getattr(batch, "processed", None)
    return int(processed) if processed is not None else int(batch.attention_mask.sum())


def update_throughput(base_params: int, logical_tokens: int, executed: int, rescored: int, epochs_run: int,
                      seconds: float, reference: bool = True) -> dict:
    """The update's throughput metrics. ``executed``: tokens run by the training passes of all epochs;
    ``rescored``: tokens run by the rescoring pass (0 at one epoch); ``reference``: whether each training
    pass ran the reference forward too."""
    per_token = EXECUTED_FLOPS_PER_TOKEN - (0 if reference else REFERENCE_FLOPS_PER_TOKEN)
    effective = (per_token * epochs_run + (RESCORE_FLOPS_PER_TOKEN if rescored else 0)) * base_params * logical_tokens
    done = per_token * base_params * executed + RESCORE_FLOPS_PER_TOKEN * base_params * rescored
    return {
        "learner/tokens_per_s": logical_tokens * epochs_run / seconds,
        "learner/tflops_effective": effective / seconds / 1e12,
        "learner/tflops_executed": done / seconds / 1e12,
        "learner/executed_tokens": executed + rescored,
    }


@dataclass
class UpdateSums:
    """One epoch's metric numerators on this rank, summed over its micro-batches; ``totals`` adds every
    rank's and divides: what one rank running all the micro-batches would report."""

    kept: int = 0  # samples in the loss
    loss: float = 0.0
    kl: float = 0.0
    clip: float = 0.0
    tis_weight: float = 0.0  # truncated importance weights (grpo.tis_cap) over the kept tokens
    tis_capped: int = 0
    tis_tokens: int = 0

    def add_loss(self, m: dict) -> None:
        """A micro-batch's ``grpo_loss`` sums."""
        self.loss, self.kl, self.clip = self.loss + m["loss_sum"], self.kl + m["kl_sum"], self.clip + m["clip_sum"]
        self.kept += m["samples"]

    def add_weights(self, weights, on, cap: float) -> None:
        """A micro-batch's truncated importance weights on its kept tokens ``on``."""
        self.tis_weight += float(weights[on].sum())
        self.tis_capped += int((weights[on] >= cap).sum())
        self.tis_tokens += int(on.sum())

    def totals(self, dp, device, masked: int, tis: bool) -> dict:
        """Sums over every rank, then the batch means (``kept`` and ``masked`` as counts)."""
        kept, loss, kl, clip, masked = dp.sum_values([self.kept, self.loss, self.kl, self.clip, masked], device)
        kept = int(kept)
        out = {"loss": loss / kept if kept else 0.0, "kl_mean": kl / kept if kept else 0.0,
               "clip_frac": clip / kept if kept else 0.0, "kept": kept, "masked": int(masked)}
        if tis:
            weight, capped, tokens = dp.sum_values([self.tis_weight, self.tis_capped, self.tis_tokens], device)
            out["tis/weight_mean"] = weight / max(tokens, 1)
            out["tis/capped_frac"] = capped / max(tokens, 1)
        return out


def warn_masked(masked: int, n: int, threshold: float, overlap: bool) -> None:
    """Samples left out of the loss for their rollout/learner mismatch: a sign of a broken sync."""
    if masked:
        warnings.warn(f"learner: {masked}/{n} samples masked (rollout/learner logprob k3 > {threshold}): weight "
                      "sync or injection may have failed"
                      + (", or one step moved the policy that far (grpo.overlap_rollout samples one step behind)"
                         if overlap else ""), RuntimeWarning)

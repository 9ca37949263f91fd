"""The GRPO learner: fused micro-batched updates of the policy LoRA.

One ``update`` = per micro-batch: policy forward (with grad), reference forward (no grad, frozen
"reference" adapter; none when ``grpo.kl_beta`` is 0), loss, backward, free; then one clipped
optimiser step, skipped when the loss or the gradient norm is not finite (clipping does not sanitise
NaN: stepping would poison Adam's moments and the weights). Micro-batches are packed rows
(``learner.packing``: a group's prompt once, its responses after it) unless ``learner.forward: padded``.
The plan is ``learner.micro_batches``'s, the throughput figures ``learner.update_metrics``'s, export and
checkpoints ``learner.checkpoint``'s.
"""
from __future__ import annotations

import math
import time
import warnings
from pathlib import Path

import torch

from nla_grpo.learner import checkpoint
from nla_grpo.learner.lora_compute import reusing_casts
from nla_grpo.learner.grpo import grpo_loss, logprob_mismatch, pad_rows, ragged_mismatch, tis_weights
from nla_grpo.learner.micro_batches import Item, MicroBatches, items_from
from nla_grpo.learner.policy import POLICY, REFERENCE, Policy
from nla_grpo.learner.update_metrics import (THROUGHPUT_KEYS, UpdateSums, base_parameter_count, executed_tokens,
                                    update_throughput, warn_masked)
from nla_grpo.shared.collective import GradientSums


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (a phase's timing then measures the work, not its launch)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Learner:
    """HF + PEFT policy trained with GRPO; see the module doc string for one update's shape."""

    def __init__(self, cfg, spec, device: str = "cpu", data_parallel=None):
        from nla_grpo.shared.collective import DataParallel
        from nla_grpo.shared.torch_utils import make_adamw

        self.cfg, self.spec = cfg, spec
        self.device = torch.device(device)
        # this learner's place among the data-parallel ranks: each update sees its shard of the batch,
        # and sums (gradients, counts, metric numerators) run over every rank before they are used
        self.dp = data_parallel or DataParallel()
        self.policy = Policy(cfg, spec, device)
        self.model = self.policy.model
        self.params = self.policy.trainable_parameters()
        self.param_names = list(self.policy.adapter_parameters(POLICY))
        self.optimizer = make_adamw(self.params, cfg.learner.lr, cfg.learner.optimizer)
        self.step = 0
        self.version = 1  # the initial adapter is version 1, so rollouts can load it before step 0
        self.micro_batches = MicroBatches(cfg, self.policy, self.dp, self.device)
        self.base_params = base_parameter_count(self.model)
        self.executed = 0  # tokens this rank's forwards ran in the current update (learner.update_metrics)
        # the reference forward is only there for the KL term: a third of the update's FLOPs, spared at kl_beta 0
        self.reference_pass = cfg.grpo.kl_beta > 0

    # ---- micro-batches (learner.micro_batches) ------------------------------------------------
    @property
    def micro_batch_tokens(self) -> int | None:
        """The token budget ``micro_batch: auto`` chose (kept in checkpoints), or None."""
        return self.micro_batches.budget

    @micro_batch_tokens.setter
    def micro_batch_tokens(self, value: int | None) -> None:
        self.micro_batches.budget = value

    def planned_tokens(self) -> tuple[int | None, int | None]:
        """(the budget ``micro_batch: auto`` would plan with the memory free now, the one it keeps), both None
        under a fixed micro-batch. The driver asks before the first step, the engines awake, to decide
        ``rollout.sleep_during_update: auto`` (``shared.resolve.sleep_at_start``)."""
        if self.cfg.learner.micro_batch != "auto":
            return None, None
        return self.micro_batches.plan_budget(self.params, self.optimizer), self.micro_batch_tokens

    def micro_batches_of(self, items: list[Item], mine: bool = True):
        """``(indices, batch)`` per micro-batch of ``items`` under this learner's memory plan (``mine``: this rank's only)."""
        return self.micro_batches(items, self.params, self.optimizer, mine)

    # ---- scoring -------------------------------------------------------------------------------
    @torch.no_grad()
    def score_items(self, items: list[Item], adapter: str, mine: bool = True) -> list[torch.Tensor]:
        """Logprobs per item (``mine``: only for this rank's micro-batches, None elsewhere)."""
        out: list = [None] * len(items)
        was_training = self.model.training
        self.model.eval()
        try:
            with reusing_casts():  # the adapter's bf16 casts made once for every micro-batch (lora_compute)
                for idx, batch in self.micro_batches_of(items, mine):
                    with self.policy.injecting(batch), self.policy.using(adapter):
                        logp, _ = self.policy.forward_logprobs(batch)
                    self.executed += executed_tokens(batch)
                    for r, i in enumerate(idx):
                        out[i] = logp[r, : len(items[i].response_ids)].cpu()
        finally:
            self.model.train(was_training)
        return out

    def logprobs(self, samples, vectors, adapter: str = POLICY) -> list[list[float]]:
        """Per-token response logprobs under ``adapter`` ("default" or "reference"); [] for empty responses."""
        if adapter not in (POLICY, REFERENCE):
            raise ValueError(f"adapter: expected {POLICY!r} or {REFERENCE!r}, found {adapter!r}")
        items = items_from(samples, vectors)
        result: list[list[float]] = [[] for _ in samples]
        for it, lp in zip(items, self.score_items(items, adapter, mine=False)):
            result[it.index] = lp.tolist()
        return result

    # ---- training --------------------------------------------------------------------------------
    def _accumulate(self, items: list[Item], old: list[torch.Tensor], keep: list[bool] | None) -> dict:
        """Fused forward/reference/loss/backward over micro-batches; gradients left in ``.grad``.

        ``keep=None`` decides the mismatch mask from each micro-batch's own forward (old = rollout
        logprobs). Each chunk's loss is divided by the number of samples so the summed gradients
        are those of the batch mean; masked samples are corrected for afterwards.
        """
        g = self.cfg.grpo
        n = len(items)  # every rank holds the whole batch and runs its share of the micro-batches
        totals = UpdateSums()
        decide = keep is None
        keep = list(keep) if keep is not None else [True] * n
        mm_abs, mm_k3 = [0.0] * n, [0.0] * n
        mine: list[int] = []  # the items this rank scored
        # on one rank autograd's own fp32 accumulation (the fastest path); on several, float64 sums, so
        # the result does not depend on how the micro-batches were dealt
        sums = GradientSums(self.params, several=self.dp.world_size > 1)
        self.model.train()
        for idx, batch in self.micro_batches_of(items):
            mine += idx
            self.executed += executed_tokens(batch)
            chunk = [items[i] for i in idx]
            T = max(len(it.response_ids) for it in chunk)
            adv = torch.tensor([it.advantage for it in chunk], dtype=torch.float32, device=self.device)
            old_lp = pad_rows([old[i] for i in idx], T, self.device)
            rollout = pad_rows([it.rollout_logp for it in chunk], T, self.device) if decide or g.tis_cap is not None else None
            with self.policy.injecting(batch):
                new_lp, mask = self.policy.forward_logprobs(batch)
                ref_lp = None
                if self.reference_pass:
                    with torch.no_grad(), self.policy.using(REFERENCE):
                        ref_lp, _ = self.policy.forward_logprobs(batch)
                if decide:
                    a, k = logprob_mismatch(rollout, new_lp, mask)
                    for i, x, y in zip(idx, a.tolist(), k.tolist()):
                        mm_abs[i], mm_k3[i] = x, y
                        keep[i] = math.isfinite(y) and y <= self.cfg.learner.mismatch_mask_k3
                row_keep = torch.tensor([keep[i] for i in idx], device=self.device)
                weights = None
                if g.tis_cap is not None:
                    # the ratio against the learner's own logprobs before the step (this forward's, at one
                    # epoch), the engine's sampling corrected by the truncated weight
                    if decide:
                        old_lp = new_lp.detach()
                    weights = tis_weights(old_lp, rollout, mask, g.tis_cap)
                    totals.add_weights(weights, mask & row_keep.reshape(-1, 1), g.tis_cap)
                # a masked row still sits in the graph: a non-finite old logprob there would turn its
                # zero upstream gradient into NaN (0 * NaN) for the whole step
                old_lp = torch.where(torch.isfinite(old_lp), old_lp, new_lp.detach())
                # each micro-batch's loss over the batch's sample count: their gradients add up to the batch's
                loss, m = grpo_loss(new_lp, old_lp, ref_lp, adv, mask, g.clip_eps, g.kl_beta, sample_mask=row_keep,
                                    denominator=n, token_weights=weights)
                if m["samples"]:
                    loss.backward()
                    sums.add()
                    totals.add_loss(m)
            del new_lp, ref_lp, loss
        out = totals.totals(self.dp, self.device, sum(1 for i in mine if not keep[i]), g.tis_cap is not None)
        out["keep"] = keep
        sums.finish(self.dp)
        if 0 < out["kept"] < n:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(n / out["kept"])
        if decide:
            mm_abs_sum, mm_k3_sum = self.dp.sum_values([sum(mm_abs), sum(mm_k3)], self.device)
            out["mismatch"] = (mm_abs_sum / n, mm_k3_sum / n)
        return out

    def optimizer_step(self, loss: float, kept: int) -> tuple[float, bool]:
        """Clip and step; returns (grad norm, skipped). Weights and optimiser state move only on success."""
        if kept == 0:
            self.optimizer.zero_grad(set_to_none=True)
            return 0.0, True
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.learner.max_grad_norm))
        if not (math.isfinite(norm) and math.isfinite(loss)):
            self.optimizer.zero_grad(set_to_none=True)
            warnings.warn(f"learner: non-finite loss {loss} or grad norm {norm}: optimiser step skipped", RuntimeWarning)
            return norm, True
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.version += 1
        return norm, False

    def update(self, samples, advantages, vectors) -> dict:
        """One GRPO update on ``samples`` (``vectors[i]`` = sample i's activation); returns its metrics.

        ``old`` logprobs are the rollout's (their ratio also absorbs the small engine mismatch); with
        ``ppo_epochs > 1`` they are recomputed by the learner first and that many steps are taken.
        Samples whose mismatch k3 exceeds ``mismatch_mask_k3`` are left out of the loss.
        """
        with reusing_casts():  # the adapters' casts made once per weight version, not per micro-batch (lora_compute)
            return self._update(samples, advantages, vectors)

    def _update(self, samples, advantages, vectors) -> dict:
        items = items_from(samples, vectors, advantages)
        epochs = self.cfg.learner.ppo_epochs
        sync_device(self.device)
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        kl = ("kl_mean",) if self.reference_pass else ()  # no reference pass, no KL to report
        if not items:
            return {"loss": 0.0, "grad_norm": 0.0, **dict.fromkeys(kl, 0.0), "clip_frac": 0.0, "logprob_mismatch_mean_abs": 0.0,
                    "logprob_mismatch_k3": 0.0, "masked": 0, "skipped": True, **dict.fromkeys(THROUGHPUT_KEYS, 0.0),
                    "learner/micro_batch_tokens": self.micro_batch_tokens or 0}
        rollout = [it.rollout_logp for it in items]
        self.executed = 0
        if epochs > 1:
            # this rank's micro-batches only (the others' old logprobs are theirs to compute)
            old = [o if o is not None else r for o, r in zip(self.score_items(items, POLICY), rollout)]
            per_abs, per_k3 = ragged_mismatch(rollout, old)
            keep = [math.isfinite(x) and x <= self.cfg.learner.mismatch_mask_k3 for x in per_k3]
            # an item of another rank's share compares its rollout logprobs with themselves: 0, counted there
            mm_abs, mm_k3 = (v / len(items) for v in self.dp.sum_values([sum(per_abs), sum(per_k3)], self.device))
        else:
            old, keep = rollout, None
        rescored, self.executed = self.executed, 0
        stepped, ran, norm = 0, 0, 0.0
        for _ in range(epochs):
            stats = self._accumulate(items, old, keep)
            ran += 1
            if keep is None:
                keep = stats["keep"]
                mm_abs, mm_k3 = stats["mismatch"]
            masked = stats["masked"]
            norm, skipped = self.optimizer_step(stats["loss"], stats["kept"])
            if skipped:
                break
            stepped += 1
        # "skipped" means the weights did not move at all; a later epoch failing after an earlier
        # one stepped still changed the policy (and its version), which must be pushed
        skipped = stepped == 0
        warn_masked(masked, len(items), self.cfg.learner.mismatch_mask_k3, self.cfg.grpo.overlap_rollout)
        if self.device.type == "cuda" and self.cfg.placement.mode == "colocated" and (
                self.cfg.critic.train or self.cfg.rollout.sleep_during_update):
            # the GPU is shared: the critic's co-training step and vLLM's wake-up come next and need the
            # memory this update's micro-batches were sized to fill (micro_batch auto)
            torch.cuda.empty_cache()
        sync_device(self.device)
        seconds = time.perf_counter() - t0
        # tokens as an unpacked forward sees them (prompt + response per sample), and what every rank's
        # forwards really ran (learner.throughput has both FLOP counts)
        tokens = sum(len(it.prompt_ids) + len(it.response_ids) for it in items)
        executed, rescored = self.dp.sum_values([self.executed, rescored], self.device)
        return {
            "loss": stats["loss"], "grad_norm": norm, **{k: stats[k] for k in kl}, "clip_frac": stats["clip_frac"],
            "logprob_mismatch_mean_abs": mm_abs, "logprob_mismatch_k3": mm_k3,
            "masked": masked, "skipped": skipped,
            **update_throughput(self.base_params, tokens, int(executed), int(rescored), ran, seconds, self.reference_pass),
            "learner/micro_batch_tokens": self.micro_batch_tokens or 0,
            **{k: v for k, v in stats.items() if k.startswith("tis/")},
        }

    # ---- export and checkpoints (learner.checkpoint) ----------------------------------------------
    def export_adapter(self, device: str = "cpu"):
        """The policy adapter as pushed to the engines (``learner.checkpoint.export_adapter``)."""
        return checkpoint.export_adapter(self, device)

    def checksum(self) -> list[float]:
        """A fingerprint of the trained state, equal on ranks that took the same steps (``learner.checkpoint``)."""
        return checkpoint.checksum(self)

    def save(self, directory, reference: str | None = None) -> Path:
        """Policy adapter, optimiser state, RNG, step and version, atomically (``learner.checkpoint.save``)."""
        return checkpoint.save(self, directory, reference)

    def save_reference(self, directory) -> Path:
        """The frozen reference adapter alone (written once per run; checkpoints then point at it)."""
        return checkpoint.save_reference(self, directory)

    def load(self, directory) -> None:
        """Restore a ``save``d state exactly (``learner.checkpoint.load``)."""
        checkpoint.load(self, directory)

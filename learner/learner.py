"""The GRPO learner: fused micro-batched updates of the policy LoRA, adapter export, full-state checkpoints.

One ``update`` = per micro-batch: policy forward (with grad), reference forward (no grad, frozen
"reference" adapter), loss, backward, free; then one clipped optimiser step, skipped when the loss
or the gradient norm is not finite (clipping does not sanitise NaN: stepping would poison Adam's
moments and the weights). Micro-batches are packed rows (``learner.packing``: a group's prompt once,
its responses after it) unless ``learner.forward: padded``.
"""
from __future__ import annotations

import math
import time
import warnings
from pathlib import Path

import torch

from learner import checkpoint
from learner.grpo import grpo_loss, logprob_mismatch, tis_weights
from learner.micro_batches import Item, MicroBatches, items_from
from learner.policy import POLICY, REFERENCE, Policy
from shared.collective import GradientSums



def _base_parameter_count(model) -> int:
    """Parameters of the frozen base (the adapters left out; a 4-bit weight counted at its full shape)."""
    n = 0
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        shape = getattr(getattr(p, "quant_state", None), "shape", None)
        n += math.prod(shape) if shape is not None else p.numel()
    return n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _padded(rows: list[torch.Tensor], T: int, device) -> torch.Tensor:
    out = torch.zeros(len(rows), T, dtype=torch.float32)
    for r, x in enumerate(rows):
        out[r, : x.numel()] = x
    return out.to(device)


def _mismatch(rollout: list[torch.Tensor], learner: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """Per-sample (mean |Δlogp|, k3) between ragged rollout and learner logprob rows."""
    if not rollout:  # a data-parallel rank with no sample
        return [], []
    T = max(x.numel() for x in rollout)
    mask = torch.arange(T).unsqueeze(0) < torch.tensor([x.numel() for x in rollout]).unsqueeze(1)
    a, k = logprob_mismatch(_padded(rollout, T, "cpu"), _padded(learner, T, "cpu"), mask)
    return a.tolist(), k.tolist()


class Learner:
    """HF + PEFT policy trained with GRPO; see the module doc string for one update's shape."""

    def __init__(self, cfg, spec, device: str = "cpu", data_parallel=None):
        from shared.collective import DataParallel
        from shared.torch_utils import make_adamw

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
        self.base_params = _base_parameter_count(self.model)

    # ---- micro-batches (learner.micro_batches) ------------------------------------------------
    @property
    def micro_batch_tokens(self) -> int | None:
        """The token budget ``micro_batch: auto`` chose (kept in checkpoints), or None."""
        return self.micro_batches.budget

    @micro_batch_tokens.setter
    def micro_batch_tokens(self, value: int | None) -> None:
        self.micro_batches.budget = value

    def _micro_batches(self, items: list[Item], mine: bool = True):
        return self.micro_batches(items, self.params, self.optimizer, mine)

    # ---- scoring -------------------------------------------------------------------------------
    @torch.no_grad()
    def _score(self, items: list[Item], adapter: str, mine: bool = True) -> list[torch.Tensor]:
        """Logprobs per item (``mine``: only for this rank's micro-batches, None elsewhere)."""
        out: list = [None] * len(items)
        was_training = self.model.training
        self.model.eval()
        try:
            for idx, batch in self._micro_batches(items, mine):
                with self.policy.injecting(batch), self.policy.using(adapter):
                    logp, _ = self.policy.forward_logprobs(batch)
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
        for it, lp in zip(items, self._score(items, adapter, mine=False)):
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
        kept, loss_sum, kl_sum, clip_sum = 0, 0.0, 0.0, 0.0
        tis_sum, tis_capped, tis_tokens = 0.0, 0, 0
        decide = keep is None
        keep = list(keep) if keep is not None else [True] * n
        mm_abs, mm_k3 = [0.0] * n, [0.0] * n
        mine: list[int] = []  # the items this rank scored
        # on one rank autograd's own fp32 accumulation (the fastest path); on several, float64 sums, so
        # the result does not depend on how the micro-batches were dealt
        sums = GradientSums(self.params, several=self.dp.world_size > 1)
        self.model.train()
        for idx, batch in self._micro_batches(items):
            mine += idx
            chunk = [items[i] for i in idx]
            T = max(len(it.response_ids) for it in chunk)
            adv = torch.tensor([it.advantage for it in chunk], dtype=torch.float32, device=self.device)
            old_lp = _padded([old[i] for i in idx], T, self.device)
            rollout = _padded([it.rollout_logp for it in chunk], T, self.device) if decide or g.tis_cap is not None else None
            with self.policy.injecting(batch):
                new_lp, mask = self.policy.forward_logprobs(batch)
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
                    on = mask & row_keep.reshape(-1, 1)
                    tis_sum += float(weights[on].sum())
                    tis_capped += int((weights[on] >= g.tis_cap).sum())
                    tis_tokens += int(on.sum())
                # a masked row still sits in the graph: a non-finite old logprob there would turn its
                # zero upstream gradient into NaN (0 * NaN) for the whole step
                old_lp = torch.where(torch.isfinite(old_lp), old_lp, new_lp.detach())
                # each micro-batch's loss over the batch's sample count: their gradients add up to the batch's
                loss, m = grpo_loss(new_lp, old_lp, ref_lp, adv, mask, g.clip_eps, g.kl_beta, sample_mask=row_keep,
                                    denominator=n, token_weights=weights)
                if m["samples"]:
                    loss.backward()
                    sums.add()
                    loss_sum, kl_sum, clip_sum = loss_sum + m["loss_sum"], kl_sum + m["kl_sum"], clip_sum + m["clip_sum"]
                    kept += m["samples"]
            del new_lp, ref_lp, loss
        # the sums over every rank's micro-batches: what one rank running them all would hold
        kept, loss_sum, kl_sum, clip_sum, masked = self.dp.sum_values(
            [kept, loss_sum, kl_sum, clip_sum, sum(1 for i in mine if not keep[i])], self.device)
        kept = int(kept)
        sums.finish(self.dp)
        if 0 < kept < n:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(n / kept)
        out = {
            "loss": loss_sum / kept if kept else 0.0,
            "kl_mean": kl_sum / kept if kept else 0.0,
            "clip_frac": clip_sum / kept if kept else 0.0,
            "kept": kept,
            "keep": keep,
            "masked": int(masked),
        }
        if decide:
            mm_abs_sum, mm_k3_sum = self.dp.sum_values([sum(mm_abs), sum(mm_k3)], self.device)
            out["mismatch"] = (mm_abs_sum / n, mm_k3_sum / n)
        if g.tis_cap is not None:
            tis_sum, tis_capped, tis_tokens = self.dp.sum_values([tis_sum, tis_capped, tis_tokens], self.device)
            out["tis/weight_mean"] = tis_sum / max(tis_tokens, 1)
            out["tis/capped_frac"] = tis_capped / max(tis_tokens, 1)
        return out

    def _optimizer_step(self, loss: float, kept: int) -> tuple[float, bool]:
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
        items = items_from(samples, vectors, advantages)
        epochs = self.cfg.learner.ppo_epochs
        _sync(self.device)
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        if not items:
            return {"loss": 0.0, "grad_norm": 0.0, "kl_mean": 0.0, "clip_frac": 0.0, "logprob_mismatch_mean_abs": 0.0,
                    "logprob_mismatch_k3": 0.0, "masked": 0, "skipped": True, "learner/tokens_per_s": 0.0,
                    "learner/tflops": 0.0, "learner/micro_batch_tokens": self.micro_batch_tokens or 0}
        rollout = [it.rollout_logp for it in items]
        if epochs > 1:
            # this rank's micro-batches only (the others' old logprobs are theirs to compute)
            old = [o if o is not None else r for o, r in zip(self._score(items, POLICY), rollout)]
            per_abs, per_k3 = _mismatch(rollout, old)
            keep = [math.isfinite(x) and x <= self.cfg.learner.mismatch_mask_k3 for x in per_k3]
            # an item of another rank's share compares its rollout logprobs with themselves: 0, counted there
            mm_abs, mm_k3 = (v / len(items) for v in self.dp.sum_values([sum(per_abs), sum(per_k3)], self.device))
        else:
            old, keep = rollout, None
        stepped, ran, norm = 0, 0, 0.0
        for _ in range(epochs):
            stats = self._accumulate(items, old, keep)
            ran += 1
            if keep is None:
                keep = stats["keep"]
                mm_abs, mm_k3 = stats["mismatch"]
            masked = stats["masked"]
            norm, skipped = self._optimizer_step(stats["loss"], stats["kept"])
            if skipped:
                break
            stepped += 1
        # "skipped" means the weights did not move at all; a later epoch failing after an earlier
        # one stepped still changed the policy (and its version), which must be pushed
        skipped = stepped == 0
        if masked:
            warnings.warn(f"learner: {masked}/{len(items)} samples masked (rollout/learner logprob k3 > "
                          f"{self.cfg.learner.mismatch_mask_k3}): weight sync or injection may have failed"
                          + (", or one step moved the policy that far (grpo.overlap_rollout samples one step behind)"
                             if self.cfg.grpo.overlap_rollout else ""), RuntimeWarning)
        if self.device.type == "cuda" and self.cfg.placement.mode == "colocated" and (
                self.cfg.critic.train or self.cfg.rollout.sleep_during_update):
            # the GPU is shared: the critic's co-training step and vLLM's wake-up come next and need the
            # memory this update's micro-batches were sized to fill (micro_batch auto)
            torch.cuda.empty_cache()
        _sync(self.device)
        seconds = time.perf_counter() - t0
        # tokens as an unpacked forward sees them (prompt + response per sample, no padding); FLOPs the
        # usual 6·N·tokens per epoch (policy forward + backward, reference forward), plus 2·N·tokens for
        # the policy's rescoring of the batch when ppo_epochs > 1
        tokens = sum(len(it.prompt_ids) + len(it.response_ids) for it in items)
        flops = (6 * ran + (2 if epochs > 1 else 0)) * self.base_params * tokens
        return {
            "loss": stats["loss"], "grad_norm": norm, "kl_mean": stats["kl_mean"], "clip_frac": stats["clip_frac"],
            "logprob_mismatch_mean_abs": mm_abs, "logprob_mismatch_k3": mm_k3,
            "masked": masked, "skipped": skipped,
            "learner/tokens_per_s": tokens * ran / seconds,
            "learner/tflops": flops / seconds / 1e12,
            "learner/micro_batch_tokens": self.micro_batch_tokens or 0,
            **{k: v for k, v in stats.items() if k.startswith("tis/")},
        }

    # ---- export and checkpoints ------------------------------------------------------------------
    def _peft_config(self, name: str) -> dict:
        from shared.fileio import jsonable

        return jsonable(self.model.peft_config[name].to_dict())

    def export_adapter(self, device: str = "cpu"):
        """The policy adapter with PEFT's saved key names, its PEFT config and version.

        Tensors are snapshots (they share no storage with the trained weights): on the CPU by
        default; ``device="same"`` keeps them on the learner's device for an engine in this process;
        ``device="live"`` hands out the trained weights themselves (detached), for a caller that
        copies them at once (``shared.weight_sync`` packs them into its buffer).
        """
        from peft import get_peft_model_state_dict

        from shared.fileio import cpu_copy
        from shared.types import AdapterUpdate

        state = get_peft_model_state_dict(self.model, adapter_name=POLICY)
        copy = {"cpu": cpu_copy, "same": lambda t: t.detach().clone().contiguous(), "live": lambda t: t.detach()}[device]
        return AdapterUpdate(version=self.version, tensors={k: copy(v) for k, v in state.items()},
                             peft_config=self._peft_config(POLICY))

    def checksum(self) -> list[float]:
        """A cheap fingerprint of the trained state (float64 sums over the policy adapter and the first
        optimiser moments): data-parallel ranks that took the same steps hold the same bits."""
        with torch.no_grad():
            total = torch.zeros(3, dtype=torch.float64, device=self.device)
            for p in self.params:
                x = p.detach().double()
                total[0] += x.sum()
                total[1] += (x * x).sum()
                moment = self.optimizer.state.get(p, {}).get("exp_avg")
                if moment is not None:
                    total[2] += moment.double().abs().sum()
        return [self.step, self.version, *total.tolist()]

    # ---- checkpoints (learner.checkpoint) --------------------------------------------------------
    def save(self, directory, reference: str | None = None) -> Path:
        """Policy adapter, optimiser state, RNG, step and version, atomically (``learner.checkpoint.save``)."""
        return checkpoint.save(self, directory, reference)

    def save_reference(self, directory) -> Path:
        """The frozen reference adapter alone (written once per run; checkpoints then point at it)."""
        return checkpoint.save_reference(self, directory)

    def load(self, directory) -> None:
        """Restore a ``save``d state exactly (``learner.checkpoint.load``)."""
        checkpoint.load(self, directory)

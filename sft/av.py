"""AV-SFT on the learner's own path: the RL policy (``learner.learner.Learner``: PEFT LoRA, packed rows,
LoRA computed in the model dtype, chunked LM-head logprobs, data-parallel ranks), with the GRPO loss
replaced by the token-mean cross-entropy of the explanation given the injected prompt.

The prompt, its marker site and the injection are the RL rollout's (the same prompt table, chat
template, ``enable_thinking`` and prefill), so the adapter learns exactly the policy RL starts from.
"""
from __future__ import annotations

import math
import time

import torch

from nla_grpo.learner import checkpoint
from nla_grpo.learner.policy import POLICY
from nla_grpo.learner.learner import Learner, sync_device
from nla_grpo.learner.micro_batches import Item
from nla_grpo.learner.update_metrics import executed_tokens
from nla_grpo.sft.plan import token_nll_sum


def _items(prompts, sites, responses, vectors) -> list[Item]:
    import numpy as np

    # a copy: arrays that crossed Ray are read-only, which torch warns about
    vecs = vectors.float() if isinstance(vectors, torch.Tensor) else torch.from_numpy(np.array(vectors, dtype=np.float32))
    return [Item(i, list(p), list(r), int(s), vecs[i], torch.empty(0), 0.0)
            for i, (p, s, r) in enumerate(zip(prompts, sites, responses))]


class AvSftLearner(Learner):
    """A ``Learner`` whose step is supervised: one clipped optimiser step on a batch of (prompt, vector,
    explanation response) rows, at the rate the caller gives (the schedule lives with the driver)."""

    def sft_step(self, prompts, sites, responses, vectors, lr: float) -> dict:
        """Token-mean cross-entropy over every response token of the batch (all ranks together), one step."""
        from nla_grpo.shared.collective import GradientSums

        items = _items(prompts, sites, responses, vectors)
        n_tokens = sum(len(r) for r in responses)
        for group in self.optimizer.param_groups:
            group["lr"] = float(lr)
        sync_device(self.device)
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        sums = GradientSums(self.params, several=self.dp.world_size > 1)
        self.model.train()
        nll_sum, executed = 0.0, 0
        for _, batch in self.micro_batches_of(items):
            with self.policy.injecting(batch):
                logp, mask = self.policy.forward_logprobs(batch)
                nll, _ = token_nll_sum(logp, mask)
                (nll / n_tokens).backward()  # shares of the batch mean: the summed gradient is the batch's
            sums.add()
            nll_sum += float(nll.detach())
            executed += executed_tokens(batch)
            del logp, nll
        nll_sum, executed = self.dp.sum_values([nll_sum, executed], self.device)
        sums.finish(self.dp)
        loss = nll_sum / max(n_tokens, 1)
        norm, skipped = self.optimizer_step(loss, len(items))
        sync_device(self.device)
        seconds = time.perf_counter() - t0
        # executed FLOPs: forward 2 and backward-to-inputs 2 per weight per token (the frozen base's weight
        # gradients are never formed; the LoRA's and attention's are a rounding error next to N): the decoder's
        # N (no embedding table, a lookup, and no LM head) on every token the rows hold, the LM head's V·d on
        # the predicted tokens only (the chunked head runs there alone)
        emb = self.model.get_input_embeddings().weight
        head = self.model.get_base_model().get_output_embeddings().weight
        decoder = self.base_params - emb.numel() - (0 if head.data_ptr() == emb.data_ptr() else head.numel())
        flops = 4 * decoder * executed + 4 * head.numel() * n_tokens
        return {"loss": loss, "grad_norm": norm, "skipped": skipped, "tokens": n_tokens, "executed_tokens": int(executed),
                "seconds": seconds, "tflops_executed": flops / seconds / 1e12 if seconds else 0.0,
                "micro_batch_tokens": self.micro_batch_tokens or 0}

    @torch.no_grad()
    def nll(self, prompts, sites, responses, vectors) -> dict:
        """Held-out token-mean NLL of the responses (every micro-batch on this rank)."""
        items = _items(prompts, sites, responses, vectors)
        logps = self.score_items(items, POLICY, mine=False)
        total = sum(float(-lp.sum()) for lp in logps)
        tokens = sum(lp.numel() for lp in logps)
        return {"nll": total / tokens if tokens else math.nan, "tokens": tokens}

    def save_adapter_dir(self, directory) -> str:
        """The trained adapter alone, as ``learner.adapter_init`` takes it: PEFT files + the injection record."""
        from nla_grpo.shared.fileio import atomic_directory

        from nla_grpo.shared.fileio import write_json
        from nla_grpo.shared.injection import SFT_RECORD

        with atomic_directory(directory) as tmp:
            checkpoint.save_adapter(self, POLICY, tmp, mkdir=False)
            lc = self.cfg.learner
            # what an RL run must agree with to start from this adapter (shared.injection.check_adapter_sft)
            write_json(tmp / SFT_RECORD, {"stage": "av", "lora_r": lc.lora_r, "lora_alpha": lc.lora_alpha,
                                          "use_rslora": lc.use_rslora, "layer_index": self.spec.layer_index,
                                          "d_model": self.spec.d_model})
        return str(directory)

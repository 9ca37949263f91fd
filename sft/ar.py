"""AR-SFT on the critic's own path: ``critic.scoring.Critic`` (truncated backbone + value head, LoRA or
full fine-tuning, data-parallel ranks), trained by the very ``train_step`` RL co-trains it with (the
normalised MSE between its prediction and the activation), at the rate the driver's schedule gives."""
from __future__ import annotations

import math
import time

from nla_grpo.critic.scoring import Critic


class ArSftCritic(Critic):
    def sft_step(self, explanations, activations, lr: float) -> dict:
        optimizer = self._ensure_optimizer()
        for group in optimizer.param_groups:
            group["lr"] = float(lr)
        t0 = time.perf_counter()
        out = self.train_step(explanations, activations)
        if str(self.device).startswith("cuda"):
            import torch

            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        ids = [x for x in self.encode(explanations) if x is not None]
        tokens = sum(len(x) for x in ids)
        # N: the backbone's matmul weights (no LoRA, no embedding table: a lookup does no matmul)
        params = sum(p.numel() for n, p in self.model.named_parameters() if "lora_" not in n and "embed_tokens" not in n)
        # executed FLOPs: 6·N per token when the whole backbone trains, 4·N with a LoRA (frozen base weights)
        per_token = 4 if self.meta.lora_r > 0 else 6
        return {"loss": out["critic_loss"], "grad_norm": out["critic_grad_norm"], "skipped": out["critic_skipped"],
                "rows": out["critic_n"], "tokens": tokens, "seconds": seconds,
                "tflops_executed": per_token * params * tokens / seconds / 1e12 if seconds else 0.0}

    def mse(self, explanations, activations) -> dict:
        scores = self.score(explanations, activations)
        ok = [s for s in scores if s is not None and math.isfinite(s)]
        return {"mse": sum(ok) / len(ok) if ok else math.nan, "scored": len(ok), "rows": len(scores)}

    def save_checkpoint_dir(self, directory) -> str:
        """Weights + meta as ``critic.checkpoint`` takes them (no optimiser state)."""
        from nla_grpo.shared.fileio import atomic_directory

        with atomic_directory(directory) as tmp:
            self.save(tmp, optimizer=False)
        return str(directory)

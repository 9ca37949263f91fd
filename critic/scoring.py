"""The critic service: batched scoring of explanations and optional co-training.

``score`` returns the normalised MSE between the critic's prediction and each gold activation
(orthogonal = 2 at the default ``sqrt_d`` scale), or None where the sample cannot be scored. It runs
micro-batches of right-padded prompts sorted by length, so a batch of 64 costs a few forwards
instead of 64.

``train_step`` is one supervised optimiser step on the valid samples, with gradient accumulation
over micro-batches scaled so that the accumulated loss is the full-batch mean. A non-finite loss or
gradient norm skips the step and leaves weights and optimiser state untouched (clipping does not
sanitise NaN, so the check must come before ``optimizer.step``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from nla_grpo.critic.checkpoint import (
    META_NAME,
    OPTIM_META_NAME,
    OPTIM_TENSORS_NAME,
    CriticMeta,
    has_optimizer_state,
    load_optimizer,
    load_weights,
    read_meta,
    save_optimizer,
    save_weights,
)
from nla_grpo.critic.model import CriticModel
from nla_grpo.shared.config import LINEAR_MODULES
from nla_grpo.shared.errors import NlaInputError
from nla_grpo.shared.prompts import render_critic_ids, start_token
from nla_grpo.shared.schema import normalized_mse

# fields that fix the critic's structure: a checkpoint must agree on all of them (its LoRA's
# target_modules have no config field: the checkpoint's own are used)
_STRUCTURE = ("num_layers", "d_model", "lora_r", "lora_alpha", "use_rslora", "quantization", "final_norm")


def _chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def critic_architecture(cfg, spec, dtype: torch.dtype) -> CriticMeta:
    """The critic's structure from the config and the sidecar, checked against ``critic.checkpoint``'s meta
    (a one-line error naming the field); reads JSON only, so the job checks it before any actor starts."""
    c = cfg.critic
    saved = read_meta(c.checkpoint) if c.checkpoint else None
    # unset LoRA settings are the checkpoint's (or none and 16 without one)
    r = c.lora_r if c.lora_r is not None else (saved.lora_r if saved else 0)
    alpha = c.lora_alpha if c.lora_alpha is not None else (saved.lora_alpha if saved else 16)
    meta = CriticMeta(
        num_layers=c.num_layers or spec.layer_index + 1,
        d_model=spec.d_model,
        lora_r=r,
        lora_alpha=alpha,
        use_rslora=True,
        target_modules=list(LINEAR_MODULES) if r > 0 else [],
        base_model=str(cfg.model.path),
        dtype=_dtype_name(dtype),
        quantization=cfg.model.quantization,
    )
    if saved is not None:
        # an AR checkpoint's own depth is used unless the config pins one; its final norm (no config field) always
        Critic._check_same_structure(saved, replace(meta, final_norm=saved.final_norm), Path(c.checkpoint) / META_NAME,
                                     explicit_layers=c.num_layers is not None)
        # the LoRA's modules are the checkpoint's (an imported AR may carry fewer than all seven)
        meta = replace(meta, num_layers=saved.num_layers, final_norm=saved.final_norm,
                       target_modules=list(saved.target_modules) if saved.lora_r > 0 else meta.target_modules)
    return meta


class Critic:
    """Owns the critic model, its tokenizer and (once training starts) its optimiser."""

    def __init__(self, cfg, spec, device: str = "cpu", data_parallel=None):
        from nla_grpo.shared.model_checks import load_tokenizer
        from nla_grpo.shared.collective import DataParallel
        from nla_grpo.shared.torch_utils import resolve_dtype

        self.cfg = cfg
        # co-training across data-parallel ranks: each sees its shard, gradients and counts are summed
        self.dp = data_parallel or DataParallel()
        self.spec = spec
        self.device = device
        self.mse_scale = spec.mse_scale
        self.tokenizer = load_tokenizer(cfg.model.path)
        pad = self.tokenizer.pad_token_id
        # with right padding the pad id is never attended by a real token; any valid id will do
        self.pad_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))
        add_bos = cfg.critic.add_bos
        self.bos = start_token(self.tokenizer) if add_bos is None else (self.tokenizer.bos_token_id if add_bos else None)
        if add_bos and self.bos is None:
            raise NlaInputError(cfg.model.path, "critic.add_bos: true, but the tokenizer has no start token (bos_token)")
        self.dtype = resolve_dtype(cfg.model.dtype, device)
        self.meta = self._architecture()
        self.model = CriticModel.from_base(cfg.model.path, self.meta.num_layers, self.dtype, self.mse_scale,
                                           d_model=spec.d_model, device=device, quantization=self.meta.quantization,
                                           final_norm=self.meta.final_norm)
        if self.meta.lora_r > 0:
            self.model.add_lora(self.meta.lora_r, self.meta.lora_alpha, self.meta.target_modules, self.meta.use_rslora)
        self.model.eval()  # no dropout in training either: scores and updates see the same function
        if cfg.critic.checkpoint:
            load_weights(cfg.critic.checkpoint, self.model)
        self.trainable = self.model.mark_trainable()
        self.optimizer = None

    # ---- structure -------------------------------------------------------------------------
    def _architecture(self) -> CriticMeta:
        return critic_architecture(self.cfg, self.spec, self.dtype)

    @staticmethod
    def _check_same_structure(saved: CriticMeta, want: CriticMeta, where: Path, explicit_layers: bool = True) -> None:
        for key in _STRUCTURE:
            if key == "num_layers" and not explicit_layers:
                continue
            if key in ("lora_alpha", "use_rslora") and want.lora_r == 0 and saved.lora_r == 0:
                continue
            a, b = getattr(saved, key), getattr(want, key)
            if a != b:
                hint = (f" (set critic.{key} to match)" if key in ("num_layers", "lora_r", "lora_alpha")
                        else " (set model.quantization to match)" if key == "quantization" else "")
                raise NlaInputError(where, f"{key}: the checkpoint has {a!r} but this critic is configured with {b!r}{hint}")

    # ---- inputs ----------------------------------------------------------------------------
    def encode(self, explanations: list[str | None]) -> list[list[int] | None]:
        """Critic prompt ids per explanation; None when missing, empty or over the token limit."""
        limit = self.cfg.critic.max_prompt_tokens
        out: list[list[int] | None] = []
        for text in explanations:
            if text is None:
                out.append(None)
                continue
            ids = render_critic_ids(self.tokenizer, self.spec.ar_template, text, self.bos)
            out.append(ids if 0 < len(ids) <= limit else None)
        return out

    def _golds(self, activations, n: int) -> torch.Tensor:
        if isinstance(activations, torch.Tensor):
            golds = activations
        elif isinstance(activations, (list, tuple)) and activations and isinstance(activations[0], torch.Tensor):
            golds = torch.stack(list(activations))
        else:
            golds = torch.as_tensor(np.asarray(activations, dtype=np.float32))
        if golds.ndim != 2 or golds.shape[0] != n or golds.shape[1] != self.spec.d_model:
            raise ValueError(f"activations: expected shape ({n}, {self.spec.d_model}), found {tuple(golds.shape)}")
        return golds.float()

    def _batch(self, ids_list: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ids and attention mask on the critic's device."""
        from nla_grpo.shared.torch_utils import right_pad

        return right_pad(ids_list, self.pad_id, self.device)

    def _length_order(self, ids: list[list[int] | None]) -> list[int]:
        # sorting by length keeps padding (wasted compute) small in every micro-batch
        return sorted((i for i, x in enumerate(ids) if x is not None), key=lambda i: len(ids[i]))

    # ---- scoring ---------------------------------------------------------------------------
    @torch.no_grad()
    def predict_ids(self, ids_list: list[list[int]]) -> torch.Tensor:
        """Predictions ``[N, d]`` (fp32, on CPU) for tokenised critic prompts, in input order."""
        out = torch.empty((len(ids_list), self.spec.d_model), dtype=torch.float32)
        order = sorted(range(len(ids_list)), key=lambda i: len(ids_list[i]))
        for chunk in _chunks(order, self.cfg.critic.micro_batch):
            out[chunk] = self.model(*self._batch([ids_list[i] for i in chunk])).cpu()
        return out

    def _plan(self, ids: list[list[int] | None]) -> list[list[int]]:
        """Micro-batches of sample indices (length-sorted valid samples); every rank makes the same plan."""
        return list(_chunks(self._length_order(ids), self.cfg.critic.micro_batch))

    def _share(self, plan: list[list[int]], ids) -> list[list[int]]:
        return [plan[j] for j in self.dp.share([sum(len(ids[i]) for i in chunk) for chunk in plan])]

    @torch.no_grad()
    def _score_chunks(self, ids, golds, chunks, n: int) -> list[float | None]:
        scores: list[float | None] = [None] * n
        for chunk in chunks:
            pred = self.model(*self._batch([ids[i] for i in chunk]))
            mse = normalized_mse(pred, golds[chunk].to(pred.device), self.mse_scale)
            for i, value in zip(chunk, mse.tolist()):
                scores[i] = value if math.isfinite(value) else None
        return scores

    def score(self, explanations: list[str | None], activations) -> list[float | None]:
        """Normalised MSE per sample; None for a missing explanation, an over-long prompt or a non-finite result."""
        ids = self.encode(explanations)
        return self._score_chunks(ids, self._golds(activations, len(explanations)), self._plan(ids), len(explanations))

    def score_share(self, explanations: list[str | None], activations) -> list[tuple[int, float | None]]:
        """``(index, score)`` for this data-parallel rank's micro-batches: ranks together score each sample once."""
        ids = self.encode(explanations)
        share = self._share(self._plan(ids), ids)
        scores = self._score_chunks(ids, self._golds(activations, len(explanations)), share, len(explanations))
        return [(i, scores[i]) for chunk in share for i in chunk]

    # ---- co-training -----------------------------------------------------------------------
    def _refuse_if_merged(self, what: str) -> None:
        # folded adapters are part of the base weights: a step on them, or their tensors saved or loaded, would
        # count the delta twice
        if self.model.merged:
            raise RuntimeError(f"cannot {what} this critic: its LoRA is merged into its base (a scorer only, merge_lora)")

    def _ensure_optimizer(self):
        self._refuse_if_merged("train")
        if self.optimizer is None:
            from nla_grpo.shared.torch_utils import make_adamw

            self.optimizer = make_adamw(self.trainable, self.cfg.critic.lr, self.cfg.critic.optimizer)
        return self.optimizer

    def train_step(self, explanations: list[str | None], activations) -> dict:
        """One optimiser step on the valid samples.

        Returns ``critic_loss`` (full-batch mean MSE before the step), ``critic_grad_norm`` (before
        clipping), ``critic_skipped`` (True when no step was taken: no valid sample, or a non-finite
        loss or norm) and ``critic_n`` (samples used). Values not computed are NaN.
        """
        from nla_grpo.shared.collective import GradientSums

        golds = self._golds(activations, len(explanations))
        ids = self.encode(explanations)
        plan = self._plan(ids)
        n = sum(len(chunk) for chunk in plan)  # every rank holds the whole batch, and runs its share
        result = {"critic_loss": float("nan"), "critic_grad_norm": float("nan"), "critic_skipped": True, "critic_n": n}
        if n == 0:
            return result
        optimizer = self._ensure_optimizer()
        optimizer.zero_grad(set_to_none=True)
        sums = GradientSums(self.trainable, several=len(plan) > 1 or self.dp.world_size > 1)
        total, finite = 0.0, True
        for chunk in self._share(plan, ids):
            pred = self.model(*self._batch([ids[i] for i in chunk]))
            # weighted by the chunk's share so that the accumulated gradient is the full-batch mean's
            loss = normalized_mse(pred, golds[chunk].to(pred.device), self.mse_scale).mean() * (len(chunk) / n)
            if not torch.isfinite(loss):
                finite = False
                break
            loss.backward()
            sums.add()
            total += float(loss.detach())
        failed, total = self.dp.sum_values([0.0 if finite else 1.0, total], self.device)
        if not failed:  # every rank decides alike: a non-finite loss anywhere skips the step everywhere
            sums.finish(self.dp)
            result["critic_loss"] = total
            norm = float(torch.nn.utils.clip_grad_norm_(self.trainable, self.cfg.critic.max_grad_norm))
            result["critic_grad_norm"] = norm
            if math.isfinite(norm):
                optimizer.step()
                result["critic_skipped"] = False
        optimizer.zero_grad(set_to_none=True)
        return result

    def checksum(self) -> list[float]:
        """A cheap fingerprint of the trained weights (float64 sums): data-parallel ranks hold the same bits."""
        with torch.no_grad():
            x = [p.detach().double() for p in self.trainable]
            return [float(sum(t.sum() for t in x)), float(sum((t * t).sum() for t in x))]

    # ---- checkpoints -----------------------------------------------------------------------
    def save(self, ckpt_dir: str | Path, optimizer: bool = True) -> None:
        """Weights + meta, and the optimiser state when there is one and ``optimizer`` is set."""
        self._refuse_if_merged("save")
        d = Path(ckpt_dir)
        d.mkdir(parents=True, exist_ok=True)
        if optimizer and self.optimizer is not None:
            save_optimizer(d, self.optimizer, self.model.trainable_names())
        else:
            # a stale optimiser state beside new weights would resume from the wrong moments
            for name in (OPTIM_TENSORS_NAME, OPTIM_META_NAME):
                (d / name).unlink(missing_ok=True)
        save_weights(d, self.model, self.meta)

    def load(self, ckpt_dir: str | Path, require_optimizer: bool = False) -> None:
        """Weights (strictly) and, when present, the optimiser state of a checkpoint saved by ``save``."""
        self._refuse_if_merged("load")
        d = Path(ckpt_dir)
        self._check_same_structure(read_meta(d), self.meta, d / META_NAME)
        if require_optimizer and not has_optimizer_state(d):
            raise NlaInputError(d, f"no critic optimiser state ({OPTIM_TENSORS_NAME} + {OPTIM_META_NAME}) to resume from")
        load_weights(d, self.model)
        if has_optimizer_state(d):
            load_optimizer(d, self._ensure_optimizer(), self.model.trainable_names())

    def describe(self) -> dict:
        trainable = sum(p.numel() for p in self.trainable)
        return {**asdict(self.meta), "trainable_params": trainable, "device": str(self.device)}

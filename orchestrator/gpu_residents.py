"""What the learner and the critic hold on a colocated GPU while the engines are awake, passed to each engine's plan
(``rollout.engine_plan`` takes it off the top of the GPU before it sizes the KV cache). The orchestrator computes it:
it knows every service, and the rollout package imports neither the learner's nor the critic's.

Estimates, not measurements: the 64 x 8 job at the 8B shape on an H100 held 31-33 GiB beside the engine (74-76 GiB
at the rollout's peak less the engine's planned 43; benchmarks/RESULTS.md §17), and this counts 32.2 GiB for it.
"""
from __future__ import annotations

from rollout.colocated_memory import base_bytes, bf16_bytes, checkpoint_config, lora_params

CONTEXT_BYTES = 600 << 20  # a process's CUDA context and kernels (non-torch memory), learner and critic each
TRAINED_PARAM_BYTES = 16  # an adapter parameter trained with AdamW: fp32 weight, gradient and two fp32 moments
ADAM_STATE_BYTES = 8  # the two fp32 moments of a weight trained in place (a critic fully fine-tuned)


def awake_update_bytes(cfg, elem: int) -> int:
    """The learner's working memory for an update beside awake engines: the activations of the smallest micro-batch
    that keeps them awake (``shared.config.least_awake_tokens``), with the planner's safety factor. Only where the
    engines cannot sleep through the update (``rollout.sleep_during_update: false``, or an overlapped rollout);
    otherwise ``auto`` puts them to sleep when the learner's room is short."""
    from learner.memory_plan import SAFETY, config_bytes_per_token
    from shared.config import least_awake_tokens, sleep_can_pay

    ro = cfg.rollout
    if ro.sleep_during_update is True or (ro.sleep_during_update == "auto" and sleep_can_pay(cfg)):
        return 0
    per_token = config_bytes_per_token(checkpoint_config(cfg), cfg.learner.lora_r, elem, cfg.learner.gradient_checkpointing)
    return int(SAFETY * per_token * least_awake_tokens(cfg) / 0.9)


def resident_bytes(cfg, elem: int, adapter: tuple[int, list[str]], critic=None) -> int:
    """What the learner and the critic hold on a colocated GPU while the engines are awake, in ``elem``-byte weights:
    the policy's base, its adapter (``(rank, targets)``) with its AdamW state, the critic's blocks with what it trains
    (``critic``: its ``critic.scoring.CriticMeta``; unknown, the whole model and the config's rank), the learner's
    working memory where the engines stay awake, and each process's CUDA context."""
    quantised = cfg.model.quantization != "none"
    layers = checkpoint_config(cfg)["num_hidden_layers"]
    base = base_bytes(cfg, elem, quantised)
    rank, targets = adapter
    learner = base + lora_params(cfg, rank, targets) * TRAINED_PARAM_BYTES + awake_update_bytes(cfg, elem)
    blocks = min(critic.num_layers if critic else (cfg.critic.num_layers or layers), layers)
    held = base * blocks / layers
    if cfg.critic.train:
        r = critic.lora_r if critic else (cfg.critic.lora_r or 0)
        if r > 0:
            held += lora_params(cfg, r, list(critic.target_modules) if critic else list(targets), blocks) * TRAINED_PARAM_BYTES
        else:  # fully fine-tuned: a gradient and two moments for every weight of its blocks
            held += bf16_bytes(cfg) / 2 * blocks / layers * (elem + ADAM_STATE_BYTES)
    return int(learner + held + 2 * CONTEXT_BYTES)


def colocated_residents(cfg, spec) -> int:
    """``resident_bytes`` for this run's colocated engines: the critic's structure from its config and checkpoint."""
    import torch

    from critic.scoring import critic_architecture
    from rollout.vllm_engine import adapter_shape
    from shared.torch_utils import resolve_dtype

    dtype = resolve_dtype(cfg.model.dtype, "cuda")
    return resident_bytes(cfg, 4 if dtype == torch.float32 else 2, adapter_shape(cfg), critic_architecture(cfg, spec, dtype))

"""What the services hold on one GPU, from the checkpoint's config and file sizes: the engine's weights, and what the
learner and the critic keep resident beside the engines while they are awake (``rollout.engine_plan`` takes the
latter off the top of the GPU before it sizes the engines' KV cache).

Estimates, not measurements: the 64 x 8 job at the 8B shape on an H100 held 31-33 GiB beside the engine (74-76 GiB
at the rollout's peak less the engine's planned 43; benchmarks/RESULTS.md §17), and this counts 32.2 GiB for it.
"""
from __future__ import annotations

import json

CONTEXT_BYTES = 600 << 20  # a process's CUDA context and kernels (non-torch memory), learner and critic each
TRAINED_PARAM_BYTES = 16  # an adapter parameter trained with AdamW: fp32 weight, gradient and two fp32 moments
ADAM_STATE_BYTES = 8  # the two fp32 moments of a weight trained in place (a critic fully fine-tuned)
NF4_SHARE = 0.35  # of the bf16 checkpoint: 4-bit linears, their scales, and the embeddings and head kept in 16 bits


def checkpoint_config(cfg) -> dict:
    """The subject model's ``config.json`` (a multimodal checkpoint's text part)."""
    from rollout.vllm_engine import model_dir

    c = json.loads((model_dir(cfg) / "config.json").read_text())
    return c.get("text_config", c)


def bf16_bytes(cfg) -> int:
    """The checkpoint's weights at two bytes each, whatever precision its files hold (a checkpoint saved in NF4
    holds ``NF4_SHARE`` of that)."""
    from rollout.vllm_engine import model_dir

    files = sum(f.stat().st_size for f in model_dir(cfg).glob("*.safetensors"))
    c = json.loads((model_dir(cfg) / "config.json").read_text())
    if c.get("quantization_config"):
        return int(files / NF4_SHARE)
    c = c.get("text_config", c)
    stored = str(c.get("torch_dtype") or c.get("dtype") or "bfloat16")
    return int(files // 2) if stored.removeprefix("torch.") == "float32" else files


def base_bytes(cfg, elem: int, quantised: bool) -> int:
    """A copy of the base held in ``elem``-byte weights, or quantised to 4 bits."""
    return int(bf16_bytes(cfg) * (NF4_SHARE if quantised else elem / 2))


def lora_params(cfg, rank: int, targets: list[str], blocks: int | None = None) -> int:
    """Parameters of a rank-``rank`` LoRA on ``targets`` in ``blocks`` decoder blocks (all where None)."""
    c = checkpoint_config(cfg)
    hidden, inter, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, (c.get("num_key_value_heads") or heads) * head_dim
    sides = {"q_proj": hidden + q, "k_proj": hidden + kv, "v_proj": hidden + kv, "o_proj": q + hidden,
             "gate_proj": hidden + inter, "up_proj": hidden + inter, "down_proj": inter + hidden}
    return rank * sum(sides.get(t, 0) for t in targets) * (c["num_hidden_layers"] if blocks is None else blocks)


def awake_update_bytes(cfg, elem: int) -> int:
    """The learner's working memory for an update beside awake engines: the activations of the smallest micro-batch
    that keeps them awake (``shared.config.least_awake_tokens``), with the planner's safety factor. Only where the
    engines cannot sleep through the update (``rollout.sleep_during_update: false``, or an overlapped rollout);
    otherwise ``auto`` puts them to sleep when the learner's room is short."""
    from learner.memory_plan import SAFETY, activation_bytes_per_token
    from shared.config import least_awake_tokens, sleep_can_pay

    ro = cfg.rollout
    if ro.sleep_during_update is True or (ro.sleep_during_update == "auto" and sleep_can_pay(cfg)):
        return 0
    c = checkpoint_config(cfg)
    heads = c["num_attention_heads"]
    per_token = activation_bytes_per_token(c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], heads,
                                           c.get("num_key_value_heads") or heads, c.get("head_dim") or c["hidden_size"] // heads,
                                           cfg.learner.lora_r, elem, cfg.learner.gradient_checkpointing)
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

"""``learner.micro_batch: auto``: how many tokens one micro-batch may hold, from the memory that is free.

The estimate counts what backward keeps per token and decoder layer (norm inputs and outputs, the
attention projections and output, the MLP intermediates, the LoRA ranks; less with fused kernels), or with gradient
checkpointing one hidden state per layer plus one layer being recomputed, times a safety factor.
The budget is rounded down to a multiple of ``QUANTUM`` tokens so that a little jitter in free memory
does not change the micro-batches (and with them the run's floating-point order); the learner keeps
the budget it chose in its checkpoints, so a resumed run uses the same one.
"""
from __future__ import annotations

import os

SAFETY = 1.5
# fused kernels with flex or varlen attention: in three runs at the 8B shape the peak less the
# weights, adapters and optimiser state was 0.98-0.99 of the count, 1.02-1.06 with the LM head's fp32 chunks (reserved
# apart); with SDPA's dense mask it was 1.13 (eager) and 1.49 (liger), 1.18 and 1.56 with the chunks: those keep the
# wider margin
SAFETY_MEASURED = 1.2
QUANTUM = 512
MIN_TOKENS, MAX_TOKENS = 512, 1 << 17
CPU_MAX_TOKENS = 16384  # the CPU path: a fixed cap, so runs do not depend on the host's free memory (unless it is short)


def activation_bytes_per_token(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                               head_dim: int, lora_r: int, elem_bytes: int, checkpointing: bool, fused: bool = False,
                               gathered_kv: bool = False) -> int:
    """Bytes that backward keeps alive per token of a policy micro-batch (before the safety factor).

    ``fused`` (``learner.kernels`` liger or compile): each norm keeps its input alone, not its fp32
    intermediates, and SwiGLU its two inputs, not the SiLU output. Then a layer keeps, per token: the two
    norms' inputs and outputs (4 h; the outputs are the LoRA inputs), the q/k norms' inputs, the attention's
    q, k, v, output and the output's copy for o_proj (4 H·d + 3 kv·d), gate, up and down's input (3 I), and
    the seven LoRA ranks. A run at the 8B shape (liger + flex, 7 groups of 1,385 tokens; 72.3 GiB
    at the peak, 23.4 GB of it weights, adapters and optimiser state) kept 0.99 of that count besides the LM head's
    three fp32 chunks.

    ``gathered_kv`` (``learner.attention`` varlen): the kernel keeps the gathered keys and values, where a prompt
    key appears once per segment reading it. At 64 x 8 a row's gathered keys are about 2x its tokens; counted
    as 2 kv·d more per token (2.8% of the fused count at the 8B shape)."""
    if fused:
        per_layer = 4 * hidden + 4 * heads * head_dim + 3 * kv_heads * head_dim + 3 * intermediate + 7 * lora_r
    else:
        per_layer = 4 * hidden + 6 * heads * head_dim + 3 * kv_heads * head_dim + 4 * intermediate + 7 * lora_r
    if gathered_kv:
        per_layer += 2 * kv_heads * head_dim
    if checkpointing:
        return (layers * hidden + per_layer) * elem_bytes
    return layers * per_layer * elem_bytes


def transient_bytes(adapter_params: int, elem: int, chunk_bytes: int | None = None) -> int:
    """What an update holds besides its micro-batch's activations: the policy's and the reference's adapter cast to
    the model dtype (``lora_compute``), and three chunks of the LM head's fp32 logits (``token_logprobs``), each
    ``chunk_bytes`` (None: ``CHUNK_BYTES``, a chunk at its largest)."""
    if chunk_bytes is None:
        from nla_grpo.learner.token_logprobs import CHUNK_BYTES

        chunk_bytes = CHUNK_BYTES
    return 2 * adapter_params * elem + 3 * chunk_bytes


def safety(fused: bool, attention: str) -> float:
    """The factor on the count: ``SAFETY_MEASURED`` where the count was measured to hold (fused kernels, flex or
    varlen attention), ``SAFETY`` elsewhere."""
    return SAFETY_MEASURED if fused and attention in ("flex", "varlen") else SAFETY


def token_budget(free_bytes: int, per_token: int, reserve_bytes: int = 0, factor: float = SAFETY) -> int:
    """Tokens per micro-batch that fit in ``free_bytes - reserve_bytes`` (at least ``MIN_TOKENS``)."""
    usable = 0.9 * max(free_bytes - reserve_bytes, 0)
    tokens = int(usable / (factor * per_token)) // QUANTUM * QUANTUM
    return max(MIN_TOKENS, min(MAX_TOKENS, tokens))


def free_bytes(device) -> int:
    """Free memory on ``device``: the GPU's free memory plus what torch's cache holds unused; on the CPU, RAM."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def config_bytes_per_token(config, lora_r: int, elem_bytes: int, checkpointing: bool, fused: bool = False,
                           gathered_kv: bool = False) -> int:
    """``activation_bytes_per_token`` for a model's config: transformers' config object, or its ``config.json``
    read as a dict (the colocated plan reads it before any model loads)."""
    def get(key):
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    heads = get("num_attention_heads")
    return activation_bytes_per_token(get("hidden_size"), get("intermediate_size"), get("num_hidden_layers"), heads,
                                      get("num_key_value_heads") or heads, get("head_dim") or get("hidden_size") // heads,
                                      lora_r, elem_bytes, checkpointing, fused, gathered_kv)


def plan_tokens(model_config, lora_r: int, elem_bytes: int, checkpointing: bool, device,
                reserve_bytes: int = 0, fused: bool = False, attention: str = "sdpa") -> int:
    """The micro-batch token budget for this model on ``device`` now (``attention`` as resolved)."""
    import torch

    per_token = config_bytes_per_token(model_config, lora_r, elem_bytes, checkpointing, fused, attention == "varlen")
    budget = token_budget(free_bytes(device), per_token, reserve_bytes, safety(fused, attention))
    return budget if torch.device(device).type == "cuda" else min(budget, CPU_MAX_TOKENS)

"""How big a vLLM engine is made for one step's batch: scheduler limits, CUDA-graph sizes, KV reservation.

Pure functions of the run config and the model's shape, so the sizes can be tested without an engine:

- ``max_num_seqs: auto``: every sample an engine gets in one step runs in one decode batch
  (``prompts_per_step × group_size / num_engines``, rounded up to 16), unless a colocated KV cache is
  capped (below).
- CUDA graphs cover the decode batch: vLLM's own capture list stops at ``min(2·max_num_seqs, 512)``,
  so a 1,024-sample decode ran without graphs; here the list goes on in steps of 64 up to
  ``max_num_seqs``.
- ``max_num_batched_tokens`` holds at least the full decode batch and vLLM's default of 16,384 on large GPUs.
- ``gpu_memory_utilization: auto``: colocated, the engine reserves the KV cache one step needs (a group's
  shared prompt blocks once with prefix caching, each sample's own tail and response blocks), +25%,
  and asks for weights + that + a fixed ``ENGINE_OVERHEAD_BYTES`` for activations and graphs; the
  rest of the GPU is the learner's and the critic's. What they hold while the engine is awake
  (``resident_bytes``, ``orchestrator.memory_budget``) comes off the top first. Where one step's KV does not
  fit beside them (128 x 8 at 8B on an 80 GB card), the engine gets what is left and ``max_num_seqs: auto``
  admits only the groups whose longest KV fits, so the step runs in waves of whole groups instead of vLLM
  preempting samples late in their decode (it admits a request once its prompt fits); the learner no longer
  fails to start. On a GPU of its own an engine takes ``SPLIT_SHARE``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from nla_grpo.shared.errors import NlaInputError

BLOCK = 16  # vLLM's default KV block size on GPUs
MIN_BATCHED_TOKENS = 16384
KV_MARGIN = 1.25
ENGINE_OVERHEAD_BYTES = 8 << 30  # activations of a 16k-token prefill, CUDA graphs (1.9 GiB at 8B to batch 2048), sampler buffers
SPLIT_SHARE = 0.9
COLOCATED_SHARE = 0.95  # of the GPU, for engines + learner + critic; the rest is the CUDA contexts' and fragmentation's


@dataclass(frozen=True)
class EnginePlan:
    max_num_seqs: int
    max_num_batched_tokens: int
    capture_sizes: list[int] | None  # None: no graphs (eager)
    kv_cache_bytes: int | None  # None: vLLM sizes the KV cache from gpu_memory_utilization
    gpu_memory_utilization: float
    kv_needed_bytes: int | None = None  # colocated auto: what one step's KV holds at its longest; above kv_cache_bytes, waves

    def shortfall(self) -> str | None:
        """One line where one step's KV does not fit beside the learner and critic, else None."""
        if self.kv_needed_bytes is None or self.kv_cache_bytes is None or self.kv_cache_bytes >= self.kv_needed_bytes:
            return None
        gib = 1 << 30
        return (f"[plan] one step's KV cache ({self.kv_needed_bytes / gib:.1f} GiB) does not fit beside the learner "
                f"and critic: the engine holds {self.kv_cache_bytes / gib:.1f} GiB and decodes at most "
                f"{self.max_num_seqs} samples at once, the step in waves (placement.mode: split avoids them)")

    def engine_kwargs(self) -> dict:
        out = {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
               "gpu_memory_utilization": self.gpu_memory_utilization}
        if self.capture_sizes is not None:
            out["compilation_config"] = {"cudagraph_capture_sizes": list(self.capture_sizes),
                                         "max_cudagraph_capture_size": max(self.capture_sizes)}
        if self.kv_cache_bytes is not None:
            out["kv_cache_memory_bytes"] = self.kv_cache_bytes
        return out


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def capture_sizes(max_batch: int) -> list[int]:
    """Decode batch sizes to capture: vLLM's list (1, 2, 4, 8..248 by 8, 256..512 by 16), then by 64 up to ``max_batch``."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16), *range(576, round_up(max_batch, 64) + 1, 64)]
    top = round_up(max_batch, 16) if max_batch <= 512 else round_up(max_batch, 64)
    return [s for s in sizes if s <= top]


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Keys and values of one token in every layer."""
    return 2 * layers * kv_heads * head_dim * elem_bytes


def step_kv_tokens(groups: int, group_size: int, prompt_tokens: int, max_new_tokens: int, shared_prefix: bool,
                   block: int = BLOCK) -> int:
    """KV slots (whole blocks) one step's samples hold at their longest.

    With prefix caching a group's full prompt blocks are held once; each sample keeps the partial last
    prompt block and its response blocks (+1 for the token being written)."""
    if not shared_prefix:
        return groups * group_size * round_up(prompt_tokens + max_new_tokens + 1, block)
    full = prompt_tokens // block * block
    tail = prompt_tokens - full + max_new_tokens + 1
    return groups * (full + group_size * round_up(tail, block))


def plan_engine(ro, prompts_per_step: int, prompt_tokens: int, model_shape: dict, *, colocated: bool,
                weight_bytes: int, total_bytes: int, eager: bool, resident_bytes: int = 0,
                max_model_len: int = 0) -> EnginePlan:
    """The plan for ``ro`` (the run's ``rollout`` section) on one GPU engine.

    ``model_shape``: layers, kv_heads, head_dim, elem_bytes of the KV cache; ``weight_bytes`` what the
    engine's weights take on the GPU; ``total_bytes`` the GPU's memory; ``resident_bytes`` what the learner
    and the critic hold on it while the engines are awake (colocated); ``max_model_len`` the longest request the
    engine admits (vLLM refuses to start unless the KV cache holds one)."""
    groups = math.ceil(prompts_per_step / ro.num_engines)  # prompts one engine gets in a step
    seqs = min(4096, round_up(groups * ro.group_size, 16)) if ro.max_num_seqs == "auto" else ro.max_num_seqs
    graphs = None if eager else capture_sizes(seqs)
    kv = None
    if ro.gpu_memory_utilization != "auto":
        util = ro.gpu_memory_utilization
    elif not colocated:
        util = SPLIT_SHARE
    else:
        per_token = kv_bytes_per_token(**model_shape)
        tokens = step_kv_tokens(groups, ro.group_size, prompt_tokens, ro.max_new_tokens, ro.prefix_caching)
        needed = tokens * per_token
        room = (COLOCATED_SHARE * total_bytes - resident_bytes) / ro.num_engines - weight_bytes - ENGINE_OVERHEAD_BYTES
        per_group = step_kv_tokens(1, ro.group_size, prompt_tokens, ro.max_new_tokens, ro.prefix_caching) * per_token
        floor = max(per_group, round_up(max_model_len, BLOCK) * per_token)
        if room < floor:
            gib = 1 << 30
            raise NlaInputError("rollout.gpu_memory_utilization", (
                f"auto: a {total_bytes / gib:.1f} GiB GPU leaves an engine {max(room, 0) / gib:.1f} GiB of KV cache, "
                f"under the {floor / gib:.1f} GiB that one group (or vLLM's longest request, max_model_len "
                f"{max_model_len}) needs: the learner and critic hold about {resident_bytes / gib:.1f} GiB, each of "
                f"{ro.num_engines} engine(s) {weight_bytes / gib:.1f} GiB of weights and "
                f"{ENGINE_OVERHEAD_BYTES / gib:.0f} GiB of activations; use placement.mode: split, fewer engines, a "
                f"4-bit base or a smaller rollout.engine_options.max_model_len"))
        kv = min(max(int(needed * KV_MARGIN), floor), int(room))  # vLLM checks the floor even with the KV set
        if kv < needed and ro.max_num_seqs == "auto":  # waves of whole groups, not preemption
            seqs = min(seqs, max(1, kv // per_group) * ro.group_size)
            graphs = None if eager else capture_sizes(seqs)
        # vLLM checks at start that this share of the GPU is free; with kv_cache_memory_bytes set it
        # reserves exactly that KV cache whatever the share says
        util = min(COLOCATED_SHARE, (weight_bytes + kv + ENGINE_OVERHEAD_BYTES) / total_bytes)
        return EnginePlan(seqs, max(MIN_BATCHED_TOKENS, seqs), graphs, kv, round(util, 4), needed)
    return EnginePlan(seqs, max(MIN_BATCHED_TOKENS, seqs), graphs, kv, round(util, 4))

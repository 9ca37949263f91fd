"""What one colocated GPU holds in each phase of a step, on either ``rollout.lora`` route: the table the engine's KV
cache is sized against, the one-line refusal of a job that cannot fit (before any actor starts), and the planned
column the job benchmark sets beside each phase's measured peak.

Phases (the names of the driver's timeline): ``rollout`` (engines awake, decoding), ``score`` (the critic's forward
beside them), ``update`` (the learner's backward; the engines asleep or awake), ``push`` (the adapter into the
engines) and ``checkpoint``. Every phase holds the residents: the learner's base, its adapter with AdamW state, the
frozen reference adapter; the critic's blocks; each process's CUDA context. Besides, per route:

- ``adapter``: the engine's LoRA slots (``max_loras`` adapters of ``max_lora_rank`` in 16 bits, made at start), the
  registered version it decodes with (16 bits, outside vLLM's sleep pool, so it stays through sleep) and, in the
  push, the next version built beside it;
- ``merged``: nothing at rest; in the push, one weight's fp32 rows and delta at a time.

In the push, both routes hold the learner's export buffer (the adapter's fp32 bytes the engines read) and the
engine's received copy of it.

Estimates, not measurements: they are checked against the measured peaks of the 8B-shape jobs (the benchmark's JSON
has both per phase).
"""
from __future__ import annotations

from dataclasses import dataclass

from nla_grpo.shared.model_facts import base_bytes, bf16_bytes, lora_params, text_config

GIB = 1 << 30
CONTEXT_BYTES = 600 << 20  # a process's CUDA context and kernels (non-torch memory), learner and critic each
TRAINED_PARAM_BYTES = 16  # an adapter parameter trained with AdamW: fp32 weight, gradient and two fp32 moments
ADAPTER_PARAM_BYTES = 4  # an fp32 adapter parameter held as a copy: the frozen reference, an export buffer
LORA_ENGINE_BYTES = 2  # vLLM keeps LoRA weights in the model's 16-bit dtype
ADAM_STATE_BYTES = 8  # the two fp32 moments of a weight trained in place (a critic fully fine-tuned)
ENGINE_ASLEEP_BYTES = 2 * GIB  # a sleeping engine: its CUDA context and its CUDA graphs' pool (weights and KV are off)
FREE_MARGIN = 3 * GIB  # what every phase leaves free on the GPU (fragmentation, allocator caches, another process)
PHASES = ("rollout", "score", "update", "push", "checkpoint")


def awake_update_bytes(cfg, elem: int) -> int:
    """The learner's working memory for an update beside awake engines: the activations of the smallest micro-batch
    that keeps them awake (``shared.resolve.least_awake_tokens``), with the planner's safety factor. Only where the
    engines cannot sleep through the update (``rollout.sleep_during_update: false``, or an overlapped rollout);
    otherwise ``auto`` puts them to sleep when the learner's room is short."""
    from nla_grpo.learner.memory_plan import SAFETY, config_bytes_per_token
    from nla_grpo.shared.resolve import least_awake_tokens, sleep_can_pay

    ro = cfg.rollout
    if ro.sleep_during_update is True or (ro.sleep_during_update == "auto" and sleep_can_pay(cfg)):
        return 0
    per_token = config_bytes_per_token(text_config(cfg.model.path), cfg.learner.lora_r, elem, cfg.learner.gradient_checkpointing)
    return int(SAFETY * per_token * least_awake_tokens(cfg) / 0.9)


def critic_forward_bytes(cfg, elem: int) -> int:
    """The critic's scoring activations: one micro-batch of explanations (critic prompt + response) through one block
    at a time: the residual, the norms, q/k/v and the attention output, the MLP's gate, up and product."""
    c = text_config(cfg.model.path)
    h, i, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    d = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads") or heads
    tokens = cfg.critic.micro_batch * min(cfg.critic.max_prompt_tokens, cfg.rollout.max_new_tokens + 64)
    return tokens * (4 * h + 2 * heads * d + 2 * kv * d + 3 * i) * elem


@dataclass(frozen=True)
class Residents:
    """Bytes each service holds at rest on the colocated GPU (the engines' weights, KV cache and working memory are
    the engine plan's)."""

    learner: int  # base, adapter + AdamW state, frozen reference adapter, CUDA context
    critic: int  # its blocks, what it trains, CUDA context
    engine_lora: int  # the adapter route's slots and registered version, per engine
    adapter_fp32: int  # the policy adapter's fp32 bytes (what an export buffer or a received copy holds)
    adapter_engine: int  # one adapter version in the engine's 16 bits

    @property
    def at_rest(self) -> int:
        return self.learner + self.critic


def residents(cfg, elem: int, adapter: tuple[int, list[str]], critic=None) -> Residents:
    """``Residents`` of a colocated run in ``elem``-byte weights: the policy's base, its adapter (``(rank, targets)``)
    with its AdamW state and the reference copy, the critic's blocks with what it trains (``critic``: its
    ``critic.scoring.CriticMeta``; unknown, the whole model and the config's rank), the engine's LoRA slots on the
    adapter route, and each process's CUDA context."""
    from nla_grpo.rollout.vllm.engine import max_lora_rank_for

    quantised = cfg.model.quantization != "none"
    layers = text_config(cfg.model.path)["num_hidden_layers"]
    base = base_bytes(cfg.model.path, elem, quantised)
    rank, targets = adapter
    params = lora_params(cfg.model.path, rank, targets)
    learner = base + params * (TRAINED_PARAM_BYTES + ADAPTER_PARAM_BYTES) + CONTEXT_BYTES
    blocks = min(critic.num_layers if critic else (cfg.critic.num_layers or layers), layers)
    held = base * blocks / layers + CONTEXT_BYTES
    if cfg.critic.train:
        r = critic.lora_r if critic else (cfg.critic.lora_r or 0)
        if r > 0:
            held += lora_params(cfg.model.path, r, list(critic.target_modules) if critic else list(targets), blocks) * TRAINED_PARAM_BYTES
        else:  # fully fine-tuned: a gradient and two moments for every weight of its blocks
            held += bf16_bytes(cfg.model.path) / 2 * blocks / layers * (elem + ADAM_STATE_BYTES)
    engine_lora = 0
    if cfg.rollout.backend == "vllm" and cfg.rollout.lora == "adapter":
        slots = cfg.rollout.max_loras * lora_params(cfg.model.path, max_lora_rank_for(rank), targets)
        engine_lora = (slots + params) * LORA_ENGINE_BYTES  # the slots, and the registered version they load from
    return Residents(int(learner), int(held), int(engine_lora), params * ADAPTER_PARAM_BYTES, params * LORA_ENGINE_BYTES)


def push_bytes(cfg, res: Residents) -> int:
    """What a push adds, per engine, while the engines are awake: the learner's export buffer and the engine's
    received copy (fp32), and on the adapter route the next version built beside the registered one (on the merged
    route one weight's fp32 rows and delta, ``largest_weight_bytes``)."""
    extra = res.adapter_engine if cfg.rollout.lora == "adapter" else largest_weight_bytes(cfg)
    return 2 * res.adapter_fp32 + extra


def largest_weight_bytes(cfg) -> int:
    """The merge's transient for its largest weight (``worker_lora.merge_adapter_in_worker``): an MLP weight's rows in
    fp32, their delta ``B·A`` and the sum."""
    c = text_config(cfg.model.path)
    return 3 * c["hidden_size"] * c["intermediate_size"] * 4


def awake_beside_engines(cfg, elem: int, res: Residents) -> int:
    """The most the GPU holds besides the engines' weights, KV cache and working memory in a phase where the engines
    are awake (rollout, score, push, an awake update): what ``rollout.engine_plan`` takes off the top before it sizes
    the KV cache, so the KV fits every phase, not only the rollout."""
    n = cfg.rollout.num_engines
    awake_update = awake_update_bytes(cfg, elem)
    awake_update += learner_transient_bytes(cfg, res, elem) if awake_update else 0
    others = max(critic_forward_bytes(cfg, elem), n * push_bytes(cfg, res), awake_update)
    return res.at_rest + n * res.engine_lora + others


def phase_table(cfg, elem: int, res: Residents, engine_bytes: int, total_bytes: int, sleeps: bool,
                update_bytes: int | None = None) -> dict[str, dict[str, int]]:
    """Bytes per phase and item. ``engine_bytes``: one awake engine's weights + KV cache + working memory (its plan);
    ``sleeps``: whether the engines sleep through the update; ``update_bytes``: the learner's micro-batch activations
    (None: what ``learner.micro_batch: auto`` plans in the memory left, ``learner.memory_plan.token_budget``)."""
    n = cfg.rollout.num_engines
    rest = {"learner": res.learner, "critic": res.critic}
    awake = {**rest, "engines": n * (engine_bytes + res.engine_lora)}
    asleep = {**rest, "engines asleep": n * (ENGINE_ASLEEP_BYTES + (res.engine_lora and res.adapter_engine))}
    during_update = asleep if sleeps else awake
    if update_bytes is None:  # planned as the learner plans it: in what is free after its reserve
        free = total_bytes - sum(during_update.values()) - learner_transient_bytes(cfg, res, elem)
        update_bytes = learner_update_bytes(cfg, elem, free)
    transients = learner_transient_bytes(cfg, res, elem, update_bytes // learner_bytes_per_token(cfg, elem))
    push = {"export buffer": res.adapter_fp32, "received copy": n * res.adapter_fp32,
            ("next adapter version" if cfg.rollout.lora == "adapter" else "merge delta"):
                n * (push_bytes(cfg, res) - 2 * res.adapter_fp32)}
    return {
        "rollout": dict(awake),
        "score": {**awake, "critic forward": critic_forward_bytes(cfg, elem)},
        "update": {**during_update, "learner casts + logit chunks": transients, "learner micro-batch": update_bytes},
        "push": {**awake, **push},
        "checkpoint": dict(awake),  # the state goes to host memory tensor by tensor
    }


def _learner_kernels(cfg) -> tuple[bool, str]:
    """Whether the learner's kernels are fused and its attention, as a GPU run resolves ``auto``."""
    attention = "varlen" if cfg.learner.attention == "auto" else cfg.learner.attention
    return cfg.learner.kernels != "none", attention


def learner_bytes_per_token(cfg, elem: int) -> int:
    """What the learner's backward keeps per token (``learner.memory_plan``'s count, before its safety factor)."""
    from nla_grpo.learner.memory_plan import config_bytes_per_token

    fused, attention = _learner_kernels(cfg)
    return config_bytes_per_token(text_config(cfg.model.path), cfg.learner.lora_r, elem, cfg.learner.gradient_checkpointing,
                                  fused, attention == "varlen")


def learner_transient_bytes(cfg, res: Residents, elem: int, tokens: int | None = None) -> int:
    """``learner.memory_plan.transient_bytes`` for this run: the two adapter casts and three logit chunks. With
    ``tokens``, what a micro-batch of that many tokens holds (a chunk has no more rows than the micro-batch); without,
    what the learner sets aside before it sizes an ``auto`` micro-batch (``learner.micro_batches.plan_budget``).
    Left out, the update's planned peak sat 0.6-1.9 GiB under the measured one at the 8B shape."""
    from nla_grpo.learner.memory_plan import transient_bytes
    from nla_grpo.learner.token_logprobs import CHUNK_BYTES

    chunk = None if tokens is None else min(tokens * text_config(cfg.model.path)["vocab_size"] * 4, CHUNK_BYTES)
    return transient_bytes(res.adapter_fp32 // ADAPTER_PARAM_BYTES, elem, chunk)


def learner_update_bytes(cfg, elem: int, free: int) -> int:
    """The activations of the micro-batch ``learner.micro_batch: auto`` plans in ``free`` bytes (its count, which held
    to within 6% in the runs ``learner.memory_plan`` cites); a fixed micro-batch's rows at their longest."""
    from nla_grpo.learner.memory_plan import safety, token_budget

    per_token = learner_bytes_per_token(cfg, elem)
    if cfg.learner.micro_batch != "auto":
        return cfg.learner.micro_batch * ((cfg.rollout.max_prompt_tokens or 512) + cfg.rollout.max_new_tokens) * per_token
    return token_budget(free, per_token, 0, safety(*_learner_kernels(cfg))) * per_token


def tightest(table: dict[str, dict[str, int]], total_bytes: int) -> tuple[str, int]:
    """The phase that leaves the least free, and what it leaves (bytes; negative: it does not fit)."""
    phase = max(table, key=lambda p: sum(table[p].values()))
    return phase, total_bytes - sum(table[phase].values())


def refusal(table: dict[str, dict[str, int]], total_bytes: int) -> str | None:
    """One line where a phase leaves under ``FREE_MARGIN`` free, naming the phase and its three largest items."""
    phase, free = tightest(table, total_bytes)
    if free >= FREE_MARGIN:
        return None
    items = sorted(table[phase].items(), key=lambda kv: -kv[1])[:3]
    held = ", ".join(f"{k} {v / GIB:.1f}" for k, v in items)
    return (f"the {phase} phase would hold {sum(table[phase].values()) / GIB:.1f} of the GPU's {total_bytes / GIB:.1f} "
            f"GiB ({held} GiB ...), leaving {free / GIB:.1f} GiB free where {FREE_MARGIN / GIB:.0f} GiB must stay free: "
            f"use a smaller batch, rollout.lora: merged, a 4-bit base or placement.mode: split")


def summary(table: dict[str, dict[str, int]], total_bytes: int) -> str:
    """One line: each phase's planned peak and the least free."""
    phase, free = tightest(table, total_bytes)
    peaks = ", ".join(f"{p} {sum(v.values()) / GIB:.1f}" for p, v in table.items())
    return f"[memory] planned GiB of {total_bytes / GIB:.1f}: {peaks}; at least {free / GIB:.1f} free ({phase})"


def held_once_up(held: dict[str, dict | None], planned: dict | None) -> tuple[dict, str | None]:
    """What each service's torch holds once the services are up (``{name: {"allocated", "reserved"}}`` in bytes,
    None on the CPU) beside the plan's figure for it at rest (``ColocatedPlan.as_json()``'s rollout phase): GiB per
    service for the run directory, and one line (None where no service is on a GPU)."""
    at_rest = (planned or {}).get("phases", {}).get("rollout", {})
    table = {name: {"allocated": round(h["allocated"] / GIB, 2), "reserved": round(h["reserved"] / GIB, 2),
                    **({"planned": at_rest[name]} if name in at_rest else {}), **({"pid": h["pid"]} if "pid" in h else {})}
             for name, h in held.items() if h}
    if not table:
        return table, None
    parts = [f"{name} {t['allocated']:.1f} allocated, {t['reserved']:.1f} reserved"
             + (f" (planned {t['planned']:.1f})" if "planned" in t else "") for name, t in table.items()]
    return table, "[memory] held by torch once up, GiB: " + "; ".join(parts)


@dataclass(frozen=True)
class ColocatedPlan:
    """A colocated run's memory plan on a GPU of ``total_bytes``."""

    total_bytes: int
    beside_engines: int  # what the engines' plan takes off the top (``awake_beside_engines``)
    engine_kwargs: dict  # one engine's planned vLLM sizes (``rollout.engine_plan.EnginePlan.engine_kwargs``)
    table: dict  # ``phase_table``

    def as_json(self) -> dict:
        """GiB per phase and item, and each phase's total, for the run directory and the benchmark."""
        return {"total_gib": round(self.total_bytes / GIB, 2), "free_margin_gib": FREE_MARGIN / GIB,
                "phases": {p: {"total": round(sum(v.values()) / GIB, 2), **{k: round(b / GIB, 2) for k, b in v.items()}}
                           for p, v in self.table.items()}}


def plan_colocated(cfg, spec, total_bytes: int) -> ColocatedPlan:
    """The memory plan of a colocated vLLM run on a GPU of ``total_bytes``; raises ``NlaInputError`` (one line) where
    the engines' KV cache cannot fit or a phase would leave under ``FREE_MARGIN`` free."""
    from nla_grpo.rollout.engine_plan import ENGINE_OVERHEAD_BYTES
    from nla_grpo.rollout.vllm.engine import gpu_plan, weight_bytes
    from nla_grpo.shared.resolve import sleep_for_budget
    from nla_grpo.shared.errors import NlaInputError
    from nla_grpo.shared.torch_utils import resolve_dtype

    res, elem = colocated_residents(cfg, spec)
    dtype = resolve_dtype(cfg.model.dtype, "cuda")
    beside = awake_beside_engines(cfg, elem, res)
    ro = cfg.rollout
    kwargs = gpu_plan(cfg, dtype, total_bytes, beside).engine_kwargs()
    if ro.gpu_memory_utilization == "auto":
        engine = weight_bytes(cfg, dtype) + kwargs["kv_cache_memory_bytes"] + ENGINE_OVERHEAD_BYTES
    else:  # vLLM takes its share whole: weights, KV cache and working memory
        engine = int(ro.gpu_memory_utilization * total_bytes)
    sleeps = ro.sleep_during_update is True
    if ro.sleep_during_update == "auto":  # as the driver decides it at the start: from the learner's awake budget
        awake = {"learner": res.learner, "critic": res.critic, "engines": ro.num_engines * (engine + res.engine_lora)}
        free = total_bytes - sum(awake.values()) - learner_transient_bytes(cfg, res, elem)
        tokens = learner_update_bytes(cfg, elem, free) // learner_bytes_per_token(cfg, elem)
        sleeps = sleep_for_budget(cfg, int(tokens))
    table = phase_table(cfg, elem, res, engine, total_bytes, sleeps)
    problem = refusal(table, total_bytes)
    if problem:
        raise NlaInputError("rollout", problem)
    return ColocatedPlan(total_bytes, beside, kwargs, table)


def colocated_residents(cfg, spec) -> tuple[Residents, int]:
    """This run's ``Residents`` on the GPU (the critic's structure from its config and checkpoint) and the byte size
    of its weights there."""
    import torch

    from nla_grpo.critic.scoring import critic_architecture
    from nla_grpo.rollout.vllm.engine import adapter_shape
    from nla_grpo.shared.torch_utils import resolve_dtype

    dtype = resolve_dtype(cfg.model.dtype, "cuda")
    elem = 4 if dtype == torch.float32 else 2
    return residents(cfg, elem, adapter_shape(cfg), critic_architecture(cfg, spec, dtype)), elem


def beside_colocated_engines(cfg, spec) -> int:
    """``awake_beside_engines`` for this run: what a colocated engine's plan leaves the rest of the GPU."""
    res, elem = colocated_residents(cfg, spec)
    return awake_beside_engines(cfg, elem, res)


def gpu_total_bytes() -> int | None:
    """The smallest GPU's memory on this node as CUDA reports it to a process (``nvidia-smi``'s total less what the
    driver reserves), read without a CUDA context in the calling process; None without a GPU."""
    import subprocess

    def query(fields: str) -> list[list[float]]:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return [[float(x) for x in line.split(",")] for line in out.splitlines() if line.strip()]

    try:
        try:
            rows = [total - reserved for total, reserved in query("memory.total,memory.reserved")]
        except (subprocess.SubprocessError, ValueError):  # an older driver without memory.reserved
            rows = [total for (total,) in query("memory.total")]
    except (OSError, subprocess.SubprocessError, ValueError):  # no driver, no device: nothing to plan against here
        return None
    return int(min(rows)) << 20 if rows else None

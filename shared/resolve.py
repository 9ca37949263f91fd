"""Where every ``auto`` of the run config becomes a value: the one module that decides, at three moments.

- **Config** (``resolve_route`` and ``resolve_config``, called by the schema's validator, so every loaded config carries the values):
  ``rollout.lora`` (``lora_route``), ``weight_sync.kind`` (``weight_sync_kind``), and
  ``rollout.sleep_during_update`` where the batch alone decides it (``sleep_pays``).
- **Job** (``resolve_job``, called once the model and data are read, before any actor starts; the run directory's
  ``config.yaml`` is the config after it): ``rollout.vector_input``, ``rollout.max_prompt_tokens`` (the longest
  prompt of the data), ``logging.eval_at_start``, and the critic's LoRA rank and alpha from ``critic.checkpoint``.
- **Start** (``sleep_at_start``, with the services up): ``rollout.sleep_during_update`` where the batch does not
  decide it, from the micro-batch the learner would plan with the engines awake; it stays ``auto`` in
  ``config.yaml`` (a resume decides it again from the memory it finds), and the decision is logged.

Some ``auto`` values are policies, not missing values, and stay ``auto``: ``learner.micro_batch`` (each update
sized from the memory free then), ``rollout.gpu_memory_utilization`` and ``rollout.max_num_seqs`` (the memory plan
sizes them per card), and the learner's ``optimizer``, ``kernels`` and ``attention`` (each picks what its device
and the installed kernels offer).

Nothing here imports the schema (``shared.config`` calls in): a decision reads only the fields it names.
"""
from __future__ import annotations

STAYS_AUTO = ("learner.micro_batch", "rollout.gpu_memory_utilization", "rollout.max_num_seqs", "learner.optimizer",
              "learner.kernels", "learner.attention", "model.dtype", "rollout.sleep_during_update")
"""The fields whose ``auto`` is a policy applied as the run goes (above), left ``auto`` in a resolved config."""

MARKER_INPUT_ARCHITECTURES = ("Qwen3ForCausalLM",)
"""Architectures the multimodal vector input has a model class for (``rollout.vllm.marker_input``)."""

SLEEP_PAYS_ABOVE = 512
"""Samples per step above which sleeping a colocated engine through the update pays on a 141 GB card (8B shape):
at 128 x 8 the learner's micro-batch more than doubles and the update saves about ten times the sleep and wake-up's
cost; at 64 x 8 the two are about even."""

SLEEP_BELOW_GROUPS = 4
"""``sleep_during_update: auto`` with ``learner.micro_batch: auto``: besides where ``sleep_pays`` says so, the engines
sleep through the update when the micro-batch the learner would plan with them awake holds fewer than this many
groups' responses. On an 80 GB card (8B shape) 64 x 8 awake plans the 512-token floor, and its update is several times
slower than asleep; on a 141 GB card the same batch plans six groups awake, and at four groups sleeping is about
even."""


# ---- config time ----------------------------------------------------------------------------------------------
def lora_route(cfg) -> str:
    """``rollout.lora: auto``: merged where a vLLM engine on a GPU can merge (``merged_needs_one_vllm_engine_per_gpu``;
    not a checkpoint saved quantised, whose bf16 weights the merged engine would need), adapter elsewhere."""
    from nla_grpo.shared.model_facts import saved_quantization

    r = cfg.rollout
    saved_quantised = saved_quantization(cfg.model.path) is not None
    can_merge = (r.backend == "vllm" and cfg.placement.mode != "cpu" and r.tensor_parallel_size == 1
                 and not cfg.weight_sync.registers_from_directory and not saved_quantised)
    return "merged" if can_merge else "adapter"


def weight_sync_kind(cfg) -> str:
    """``weight_sync.kind: auto``: CUDA IPC handles on a shared GPU, an NCCL broadcast across GPUs, host memory on
    the CPU."""
    return {"colocated": "cuda_ipc", "split": "broadcast"}.get(cfg.placement.mode, "host")


def least_awake_tokens(cfg) -> int:
    """The smallest awake micro-batch budget that keeps the engines awake: ``SLEEP_BELOW_GROUPS`` groups' responses."""
    return SLEEP_BELOW_GROUPS * cfg.rollout.group_size * cfg.rollout.max_new_tokens


def sleep_can_pay(cfg) -> bool:
    """Whether sleeping can be chosen at all: colocated vLLM engines, no rollout overlapping the update."""
    return cfg.placement.mode == "colocated" and cfg.rollout.backend == "vllm" and not cfg.grpo.overlap_rollout


def sleep_pays(cfg) -> bool:
    """``rollout.sleep_during_update: auto``'s batch rule, known from the config alone: where sleeping can pay, a batch
    above ``SLEEP_PAYS_ABOVE`` samples or more than one engine. Two engines hold two copies of the weights through the
    update: at 64 x 8 that leaves the learner about the 4,096-token budget that made the awake 128 x 8 update
    30% slower than the asleep one (estimated from those figures, not run)."""
    return sleep_can_pay(cfg) and (cfg.grpo.prompts_per_step * cfg.rollout.group_size > SLEEP_PAYS_ABOVE
                                   or cfg.rollout.num_engines > 1)


def sleep_decided_by_config(cfg) -> bool:
    """Whether ``sleep_during_update: auto`` is decided with the config (else at the start, from measured memory):
    where the batch rule says sleep, where sleeping cannot pay, or where the learner's micro-batch is fixed."""
    return sleep_pays(cfg) or not sleep_can_pay(cfg) or cfg.learner.micro_batch != "auto"


def resolve_route(cfg) -> None:
    """``rollout.lora: auto`` in place: the config-time value the cross-field rules read."""
    if cfg.rollout.lora == "auto":
        cfg.rollout.lora = lora_route(cfg)


def resolve_config(cfg) -> None:
    """The other config-time ``auto`` values in place, once the cross-field rules have passed."""
    if cfg.weight_sync.kind == "auto":
        from pydantic import TypeAdapter

        variant = type(cfg).model_fields["weight_sync"].annotation  # the schema's union of variants, by its kind
        cfg.weight_sync = TypeAdapter(variant).validate_python({"kind": weight_sync_kind(cfg)})
    if cfg.rollout.sleep_during_update == "auto" and sleep_decided_by_config(cfg):
        cfg.rollout.sleep_during_update = sleep_pays(cfg)


# ---- job time -------------------------------------------------------------------------------------------------
def vector_input(cfg) -> str:
    """``rollout.vector_input: auto``: ``multimodal`` where that route has run on a GPU (the colocated placement in
    embed mode, on a Qwen3 checkpoint) and ``prompt_embeds`` elsewhere: the split placement's NCCL push into a
    V2-runner engine has not run on a GPU, karvonen mode on the route has passed its GPU parity test but no GPU job
    yet, and the CPU engines run what the demo and tests were measured on."""
    ro = cfg.rollout
    if ro.vector_input != "auto":
        return ro.vector_input
    if ro.backend != "vllm" or cfg.placement.mode != "colocated" or cfg.injection.mode != "embed":
        return "prompt_embeds"
    from nla_grpo.shared.model_facts import architectures

    archs = architectures(cfg.model.path)
    return "multimodal" if archs[:1] and archs[0] in MARKER_INPUT_ARCHITECTURES else "prompt_embeds"


def evaluates_at_start(cfg) -> bool:
    """``logging.eval_at_start: auto``: evaluate, as step 0, a run that starts from an adapter or a critic
    checkpoint (what a warm start brings, and RL must keep); never without eval steps."""
    if not cfg.logging.eval_every:
        return False
    if cfg.logging.eval_at_start == "auto":
        return bool(cfg.learner.adapter_init or cfg.critic.checkpoint)
    return bool(cfg.logging.eval_at_start)


def resolve_job(cfg, longest_prompt: int | None, critic_lora: tuple[int, int] | None) -> dict:
    """The job-time values as ``{section: {field: value}}`` updates for the config (the caller rebuilds it, so every
    rule is checked again on them). ``longest_prompt``: the data's longest AV prompt in tokens (None: no prompts);
    ``critic_lora``: ``(lora_r, lora_alpha)`` of ``critic.checkpoint`` (None: no checkpoint)."""
    updates: dict = {"rollout": {}, "logging": {}, "critic": {}}
    if cfg.rollout.vector_input == "auto":
        updates["rollout"]["vector_input"] = vector_input(cfg)
    if cfg.rollout.max_prompt_tokens is None and longest_prompt:
        updates["rollout"]["max_prompt_tokens"] = int(longest_prompt)
    if cfg.logging.eval_at_start == "auto":
        updates["logging"]["eval_at_start"] = evaluates_at_start(cfg)
    if critic_lora is not None and (cfg.critic.lora_r is None or cfg.critic.lora_alpha is None):
        updates["critic"].update(lora_r=critic_lora[0], lora_alpha=critic_lora[1])
    return {k: v for k, v in updates.items() if v}


# ---- start time -----------------------------------------------------------------------------------------------
def sleep_for_budget(cfg, awake_tokens: int | None, kept_tokens: int | None = None) -> bool:
    """``rollout.sleep_during_update: auto`` left to the start. ``awake_tokens``: the micro-batch budget the learner
    would plan now, with the engines awake (None: it plans none); ``kept_tokens``: the budget it already holds (a
    resumed run's), which must still fit. Sleep where the batch rule says so (``sleep_pays``), and also when the awake
    budget holds fewer than ``SLEEP_BELOW_GROUPS`` groups' responses or less than the kept one."""
    if sleep_pays(cfg) or not sleep_can_pay(cfg) or awake_tokens is None:
        return sleep_pays(cfg)
    return (kept_tokens is not None and kept_tokens > awake_tokens) or awake_tokens < least_awake_tokens(cfg)


def sleep_at_start(cfg, awake_tokens: int | None, kept_tokens: int | None = None) -> tuple[bool, str]:
    """``sleep_for_budget``'s decision and the line that says why."""
    sleep = sleep_for_budget(cfg, awake_tokens, kept_tokens)
    verdict = f"the engines {'sleep' if sleep else 'stay awake'} through the update"
    if awake_tokens is None:
        return sleep, f"[sleep] auto, fixed micro-batch: {verdict}"
    least = least_awake_tokens(cfg)
    why = (f"less than the {kept_tokens:,} it keeps" if kept_tokens is not None and kept_tokens > awake_tokens
           else f"{'under' if awake_tokens < least else 'at least'} {SLEEP_BELOW_GROUPS} groups' responses, {least:,}")
    return sleep, (f"[sleep] auto: with the engines awake the learner's micro-batch would hold {awake_tokens:,} tokens "
                   f"({why}): {verdict}")

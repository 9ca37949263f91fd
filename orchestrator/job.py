"""Everything a run needs that can be checked before any actor starts: config paths, spec, data, prompts.

A bad config or bad data stops here with the foundation's one-line errors.
"""
from __future__ import annotations

from dataclasses import dataclass, field as dataclass_field
from pathlib import Path

import numpy as np

from nla_grpo.orchestrator.checkpoint import RESUME_RULES
from nla_grpo.shared.config import RunConfig
from nla_grpo.shared.errors import NlaInputError


def absolute_paths(cfg: RunConfig, base: Path) -> RunConfig:
    """Make file paths absolute: actors run in other working directories."""
    def fix(p):
        return None if p is None else str((base / p).resolve()) if not Path(p).is_absolute() else p

    return cfg.model_copy(update={
        "model": cfg.model.model_copy(update={"path": fix(cfg.model.path)}),
        "data": cfg.data.model_copy(update={"parquet": fix(cfg.data.parquet), "sidecar": fix(cfg.data.sidecar)}),
        "critic": cfg.critic.model_copy(update={"checkpoint": fix(cfg.critic.checkpoint)}),
        "learner": cfg.learner.model_copy(update={"adapter_init": fix(cfg.learner.adapter_init),
                                                  "reference_adapter": fix(cfg.learner.reference_adapter)}),
        "sft": cfg.sft.model_copy(update={s: getattr(cfg.sft, s).model_copy(update={"data": fix(getattr(cfg.sft, s).data)})
                                          for s in ("av", "ar")}),
    })


@dataclass
class Job:
    cfg: RunConfig
    spec: object
    tokenizer: object
    train: object  # shared.data.RlRows
    eval: object
    prompt_ids: list  # per distinct prompt: (ids, site)
    prompt_index_train: np.ndarray  # row -> index into prompt_ids
    prompt_index_eval: np.ndarray
    fve_baseline: float
    fve_baseline_meannorm: float
    data_fingerprint: dict = None  # what a checkpoint records of the data (``data_fingerprint``)
    evals: list = dataclass_field(default_factory=list)  # the judged evals with their fixed items (evals.tasks)
    judge: object = None  # evals.judges.Judge, made and checked before any actor starts


# what `train --resume --set` may change on purpose: what a resume may change (orchestrator.checkpoint.RESUME_RULES),
# and the learning rates (the run then continues with the new rate from the checkpoint on; editing config.yaml by hand
# is still refused)
SET_ON_RESUME = RESUME_RULES["rl"].may_change + ("learner.lr", "critic.lr")


def check_resume_overrides(overrides: list[str]) -> list[str]:
    """The ``--set`` keys of a resume, each one ``SET_ON_RESUME`` allows; a one-line refusal otherwise."""
    from nla_grpo.shared.config import parse_override

    keys = []
    for item in overrides:
        key = ".".join(parse_override(item)[0])
        if not (key + ".").startswith(tuple(p if p.endswith(".") else p + "." for p in SET_ON_RESUME)):
            raise NlaInputError("--set", f"{key}: cannot change when a run resumes (it continues exactly); --resume "
                                         f"takes --set only for {', '.join(p.rstrip('.') + ('.*' if p.endswith('.') else '') for p in SET_ON_RESUME)}")
        keys.append(key)
    return keys


def data_fingerprint(rows, train, ev, spec) -> dict:
    """Row counts, the sidecar's bytes and the first rows' prompts and vectors, hashed: enough to see
    that a resumed run reads the data it was checkpointed on."""
    import hashlib
    import json

    head = hashlib.sha256(np.ascontiguousarray(rows.activations[:64]).tobytes())
    head.update(json.dumps(rows.prompts[:64], sort_keys=True).encode())
    return {"rows": len(rows), "train": len(train), "eval": len(ev),
            "sidecar_sha256": hashlib.sha256(Path(spec.path).read_bytes()).hexdigest(), "first_rows_sha256": head.hexdigest()}


def check_resume(ckpt: Path, cfg: RunConfig, job: "Job", where, changed: tuple[str, ...] = ()) -> None:
    """Refuse, in one line naming the field, a resume whose config, data or frozen critic differ from
    what the checkpoint was written with (a run saved before these were recorded is not checked). ``cfg`` and
    ``job``: the job ``prepare_job`` made, its config resolved; ``changed``: fields this resume's ``--set`` changes on
    purpose."""
    from nla_grpo.critic.checkpoint import FROZEN_RECORD, check_frozen_record

    from nla_grpo.orchestrator.checkpoint import RunState, config_change

    state = RunState.read(ckpt)

    saved = state.config
    facts = (job.prompt_ids, (cfg.critic.lora_r, cfg.critic.lora_alpha))  # what prepare_job resolved ``cfg`` with
    if saved is not None:
        from nla_grpo.shared.config import upgrade_saved_config

        saved = upgrade_saved_config(saved)  # written by an older version: compared as it would read now
        try:  # fields added since then take their defaults, as the older version behaved, and auto is resolved
            from nla_grpo.shared.config import build_config

            # with this job's facts, as the run resolved it (a config saved before shared.resolve kept auto)
            saved = _resolve(build_config(saved, str(where)), *facts).model_dump(mode="json")
        except NlaInputError:
            pass  # no longer valid as a whole: compared field by field as written
        change = config_change("rl", saved, cfg.model_dump(mode="json"), changed)
        if change:
            key, then, now = change
            raise NlaInputError(where, f"{key}: {then!r} when the checkpoint was written, {now!r} now; "
                                       "a resumed run continues exactly, so it cannot change (start a new run instead)")
    data = state.data
    if data is not None and job.data_fingerprint is not None and data != job.data_fingerprint:
        changed = [k for k in data if data.get(k) != job.data_fingerprint.get(k)]
        raise NlaInputError(where, f"the data differ from the checkpoint's ({', '.join(changed)} changed): a resumed run "
                                   "reads the rows it was checkpointed on")
    if (ckpt / FROZEN_RECORD).is_file():
        check_frozen_record(ckpt / FROZEN_RECORD, cfg.critic.checkpoint)


def _resolve(cfg: RunConfig, prompt_ids, critic_lora) -> RunConfig:
    """The job-time ``auto`` values (``shared.resolve.resolve_job``) in the config, every rule checked again on them."""
    from nla_grpo.shared.config import build_config
    from nla_grpo.shared.resolve import resolve_job

    longest = max((len(ids) for ids, _ in prompt_ids), default=None)
    updates = resolve_job(cfg, longest, critic_lora)
    if not updates:
        return cfg
    raw = cfg.model_dump(mode="python")
    for section, fields in updates.items():
        raw[section].update(fields)
    return build_config(raw, "config")


def prepare_job(cfg: RunConfig, log=print) -> Job:
    import torch

    from nla_grpo.shared.model_checks import check_model_against_spec, check_target_modules, model_config_field
    from nla_grpo.shared.data import read_rows, split_eval
    from nla_grpo.shared.prompts import as_ids, prompt_table
    from nla_grpo.shared.schema import fve_baselines
    from nla_grpo.shared.spec import load_spec, sidecar_path

    model_dir = Path(cfg.model.path)
    if not model_dir.is_dir():
        raise NlaInputError(model_dir, "model directory not found (config model.path)")
    if not Path(cfg.data.parquet).is_file():  # before its sidecar: a misspelt path is a missing parquet
        raise NlaInputError(cfg.data.parquet, "parquet not found (config data.parquet)")
    spec = load_spec(cfg.data.sidecar or sidecar_path(cfg.data.parquet))
    if cfg.injection.mode == "embed":
        spec.require_injection_scale(cfg.injection.scale)
    tok = check_model_against_spec(spec, model_dir)
    blocks = model_config_field(model_dir, "num_hidden_layers")
    # after the last block no attention is left to carry the vector to the response: it could not be read
    if cfg.injection.mode == "karvonen" and blocks is not None and cfg.injection.karvonen_layer >= blocks - 1:
        raise NlaInputError("config", f"injection.karvonen_layer: expected 0..{blocks - 2} ({model_dir} has {blocks} "
                            f"decoder blocks, and after the last one no attention layer is left to carry the vector to "
                            f"the response), found {cfg.injection.karvonen_layer}")
    if cfg.rollout.backend == "vllm":
        from nla_grpo.shared.model_checks import check_generative

        check_generative(model_dir)
    from nla_grpo.shared.quantization import prequantized

    if prequantized(model_dir, vllm=cfg.rollout.backend == "vllm") is not None and cfg.model.quantization == "none":
        raise NlaInputError("config", f"model.quantization: expected nf4 ({model_dir} is saved quantised in NF4, and "
                                      f"every service would load it so), found none")
    if cfg.model.quantization == "nf4" and cfg.rollout.backend == "vllm":
        from nla_grpo.shared.model_checks import check_quantization_source

        check_quantization_source(model_dir, cfg.model.dtype)
        if cfg.rollout.lora == "merged" and prequantized(model_dir) is not None:
            raise NlaInputError("config", f"rollout.lora: expected adapter ({model_dir} is saved quantised, and the merged "
                                          f"engine loads the bf16 checkpoint to run the NF4 base dequantised), found merged")
    from nla_grpo.critic.scoring import critic_architecture

    # the critic's structure checked against critic.checkpoint now, before any actor starts
    arch = critic_architecture(cfg, spec, torch.float32)
    if cfg.learner.adapter_init is None:  # an SFT adapter brings its own targets
        check_target_modules(model_dir, cfg.learner.target_modules)
    for field in ("adapter_init", "reference_adapter"):
        adapter = getattr(cfg.learner, field)
        if adapter is not None:
            from nla_grpo.shared.model_checks import check_adapter_dir
            from nla_grpo.shared.injection import check_adapter_injection, check_adapter_sft

            check_adapter_injection(adapter, cfg, log)
            check_adapter_sft(adapter, cfg, spec, f"learner.{field}")
            rank = check_adapter_dir(adapter, model_dir, f"learner.{field}").max_rank
            # the policy's adapter goes to vLLM's LoRA kernels on the adapter route (the reference never does)
            if field == "adapter_init" and cfg.rollout.backend == "vllm" and cfg.rollout.lora == "adapter":
                from nla_grpo.shared.config import VLLM_MAX_LORA_RANK

                if rank > VLLM_MAX_LORA_RANK:
                    raise NlaInputError(adapter, f"learner.adapter_init: LoRA rank {rank}, above {VLLM_MAX_LORA_RANK}, the "
                                                 "largest vLLM's LoRA kernels take; use rollout.lora=merged")
    for s in cfg.rollout.extra_stop_tokens:
        ids = as_ids(tok.encode(s, add_special_tokens=False))
        if len(ids) != 1:
            raise NlaInputError("config", f"rollout.extra_stop_tokens: expected {s!r} to be one token, found {len(ids)} ids {ids}")
    log(f"[data] reading {cfg.data.parquet}")
    if cfg.data.eval_skip_rows is None:
        rows = read_rows(cfg.data.parquet, spec.d_model, max_rows=cfg.data.max_rows)
        train, ev = split_eval(rows, cfg.data.eval_fraction)
    else:  # the reference trainer's split: eval rows lie past eval_skip_rows, so the whole file is read
        from nla_grpo.shared.data import split_reference

        rows = read_rows(cfg.data.parquet, spec.d_model)
        train, ev = split_reference(rows, cfg.data.max_rows, cfg.data.eval_skip_rows)
    if len(train) < cfg.grpo.prompts_per_step:
        raise NlaInputError(cfg.data.parquet, f"{len(train)} training rows, fewer than grpo.prompts_per_step={cfg.grpo.prompts_per_step}")
    if cfg.logging.eval_every and len(ev) == 0:
        raise NlaInputError(cfg.data.parquet, "no eval rows (raise data.eval_fraction or set logging.eval_every=0)")

    prompt_ids, (pi_train, pi_eval) = prompt_table([train, ev], tok, spec, cfg.rollout.prefill, cfg.data.parquet,
                                                   cfg.prompts.enable_thinking)
    golds = torch.from_numpy(train.activations[: cfg.data.fve_baseline_rows])
    meannorm, rawvar = fve_baselines(golds, spec.mse_scale)
    split = "document-disjoint" if cfg.data.eval_skip_rows is None else f"past row {cfg.data.eval_skip_rows}, document-disjoint"
    log(f"[data] {len(train)} training rows, {len(ev)} eval rows ({split}), d={spec.d_model}; "
        f"FVE baseline {rawvar:.4f} (meannorm {meannorm:.4f})")
    cfg = _resolve(cfg, prompt_ids, (arch.lora_r, arch.lora_alpha))
    evals = []
    if cfg.evals.hallucination.enabled or cfg.evals.karvonen_confusion.enabled:
        from nla_grpo.evals.tasks import build_evals

        evals = build_evals(cfg, spec, tok, ev, prompt_ids, pi_eval)
        log(f"[evals] {', '.join(f'{e.id} ({len(e.items)} items)' for e in evals)} on every eval step, judged by "
            f"{cfg.evals.judge.backend}:{cfg.evals.judge.model}")
    return Job(cfg, spec, tok, train, ev, prompt_ids, pi_train, pi_eval, rawvar, meannorm,
               data_fingerprint(rows, train, ev, spec), evals)

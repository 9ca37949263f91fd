"""``nla-grpo sft av|ar``: one SFT stage as a run directory, top to bottom.

The run directory is a training run's (``orchestrator.lifecycle``): ``config.yaml`` (the RL config the stage was
given, validated; the stage's own follows from it, ``stage_config``, and the RL job resolves what only RL uses),
``metrics.jsonl`` (one line per step, ``eval/...`` on eval steps; step 0 is the untrained eval),
``checkpoints/step_NNNNNN/`` (``state.json`` + the ranks' full state under ``model/``), ``plots/``, and
at the end the stage's product, written atomically: ``adapter/`` (AV: what ``learner.adapter_init`` and
``learner.reference_adapter`` take) or ``critic/`` (AR: what ``critic.checkpoint`` takes).

Every step's rows and rate are functions of (seed, step) (``sft.plan``), and a checkpoint holds the
weights, the optimiser's moments and the step, so a run killed and resumed ends with the adapter a
straight run ends with.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from nla_grpo.orchestrator.run_dir import RunDir
from nla_grpo.shared.errors import NlaInputError

STAGE_NAME = {"av": "AV-SFT", "ar": "AR-SFT"}


def explained_split(cfg, stage: str) -> Path:
    """The explained split the stage trains on: ``sft.<stage>.data``, else beside ``data.parquet``."""
    given = getattr(cfg.sft, stage).data
    return Path(given) if given else Path(cfg.data.parquet).parent / f"{stage}_sft.explained.parquet"


def stage_config(cfg, stage: str):
    """The config the stage's ranks are built from: a fresh adapter or critic (never the RL run's
    adapter_init / critic.checkpoint, which are what this stage makes), no judged evals, and the
    explained split as the data (its own sidecar)."""
    from nla_grpo.shared.config import build_config

    raw = cfg.model_dump(mode="python")
    raw["data"].update(parquet=str(explained_split(cfg, stage)), sidecar=None)
    raw["learner"].update(adapter_init=None, reference_adapter=None)
    raw["critic"].update(checkpoint=None, train=True, lr=cfg.sft.ar.lr)
    raw["evals"]["hallucination"]["enabled"] = False
    raw["evals"]["karvonen_confusion"]["enabled"] = False
    return build_config(raw, "config")


@dataclass
class SftData:
    job: object  # orchestrator.job.Job of the explained split: spec, tokenizer, rows, prompt table, FVE baseline
    train_explanations: list[str]
    eval_explanations: list[str]


def _explanations(path: Path, row_ids) -> list[str]:
    from nla_grpo.shared.data import read_text_column

    return read_text_column(path, "explanation", row_ids, "no 'explanation' column: the SFT stages read the explained "
                            "splits that `nla-grpo data explain SPLITS_DIR` writes")


def load_data(cfg, stage: str, log=print) -> SftData:
    """The explained split checked as training data is (``orchestrator.job.prepare_job``), with its
    explanations; a split of another model or layer than the RL data's is refused."""
    from nla_grpo.orchestrator.job import prepare_job
    from nla_grpo.shared.spec import load_spec, sidecar_path

    path = explained_split(cfg, stage)
    if not path.is_file():
        raise NlaInputError(path, f"explained split not found (sft.{stage}.data): write it with `nla-grpo data explain`")
    scfg = stage_config(cfg, stage)
    split_spec = load_spec(sidecar_path(path))
    rl_sidecar = Path(cfg.data.sidecar or sidecar_path(cfg.data.parquet))
    if rl_sidecar.is_file():
        rl_spec = load_spec(rl_sidecar)
        for key in ("layer_index", "d_model"):
            if getattr(split_spec, key) != getattr(rl_spec, key):
                raise NlaInputError(split_spec.path, f"{key}: the split has {getattr(split_spec, key)!r}, the RL data "
                                                     f"({rl_sidecar}) has {getattr(rl_spec, key)!r}: both stages must read "
                                                     "activations of the same model and layer")
    job = prepare_job(scfg, log=log)
    return SftData(job, _explanations(path, job.train.row_ids), _explanations(path, job.eval.row_ids))


# ---- the ranks ------------------------------------------------------------------------------------
def start_ranks(cfg, stage: str, spec):
    """The stage's data-parallel ranks (``placement.learner_workers`` for AV, ``critic_workers`` for AR),
    one GPU each off the CPU (one node's GPUs together where one node has them all)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from nla_grpo.orchestrator.groups import RankGroup
    from nla_grpo.orchestrator.placement import largest_node_gpus
    from nla_grpo.sft.actors import ArSftActor, AvSftActor
    from nla_grpo.shared.actors import remote

    actor = remote(AvSftActor if stage == "av" else ArSftActor)
    n = cfg.placement.learner_workers if stage == "av" else cfg.placement.critic_workers
    group = type(f"{stage}SftGroup", (RankGroup,), {"name": STAGE_NAME[stage]})
    if cfg.placement.mode == "cpu":
        return group([actor.options(num_cpus=0, num_gpus=0).remote(cfg, spec, "cpu") for _ in range(n)], "gloo"), []
    have = int(ray.cluster_resources().get("GPU", 0))
    if have < n:
        raise RuntimeError(f"{STAGE_NAME[stage]} with {n} rank(s) needs {n} GPU(s), the Ray cluster has {have}")
    pg = placement_group([{"GPU": 1, "CPU": 1}] * n, strategy="STRICT_PACK" if largest_node_gpus() >= n else "PACK")
    ray.get(pg.ready())
    actors = [actor.options(num_cpus=0, num_gpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=i)).remote(cfg, spec, "cuda") for i in range(n)]
    return group(actors, "nccl"), [pg]


def stop_ranks(group, placement_groups) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for a in (group.actors if group is not None else []):
        try:
            ray.kill(a)
        except Exception:  # already dead
            pass
    for pg in placement_groups:
        remove_placement_group(pg)


# ---- the plan: every row and step, checked before any actor starts -----------------------------------
class StagePlan:
    """The rows the stage trains and evaluates on, what each step hands the ranks, and the step count.

    Rows a rollout or the critic could never produce are left out and counted: an AV response longer
    than ``rollout.max_new_tokens`` (RL would cut it there, a failed rollout), an AR prompt longer than
    ``critic.max_prompt_tokens`` (the critic scores it as failed)."""

    def __init__(self, stage: str, data: SftData, cfg):
        import numpy as np

        from nla_grpo.sft.plan import StepBatches, total_steps

        job, s = data.job, getattr(cfg.sft, stage)
        self.stage = stage
        if stage == "av":
            from nla_grpo.rollout.engine import stop_token_ids
            from nla_grpo.sft.plan import response_ids

            stops = stop_token_ids(cfg.model.path, job.tokenizer, cfg.rollout.extra_stop_tokens)

            def rows(rl_rows, index, texts):
                prompts = [job.prompt_ids[int(k)] for k in index]
                responses = [response_ids(job.tokenizer, t, cfg.rollout.prefill, stops) for t in texts]
                ok = [len(r) <= cfg.rollout.max_new_tokens for r in responses]
                return (prompts, responses, rl_rows.activations), [len(p[0]) + len(r) for p, r in zip(prompts, responses)], ok

            self.train, lengths, ok = rows(job.train, job.prompt_index_train, data.train_explanations)
            self.eval, _, eval_ok = rows(job.eval, job.prompt_index_eval, data.eval_explanations)
            self.limit = f"rollout.max_new_tokens {cfg.rollout.max_new_tokens}"
        else:
            from nla_grpo.shared.prompts import render_critic_ids, start_token

            add_bos = cfg.critic.add_bos
            bos = start_token(job.tokenizer) if add_bos is None else (job.tokenizer.bos_token_id if add_bos else None)

            def rows(rl_rows, texts):
                n = [len(render_critic_ids(job.tokenizer, job.spec.ar_template, t, bos)) for t in texts]
                return (texts, rl_rows.activations), n, [x <= cfg.critic.max_prompt_tokens for x in n]

            self.train, lengths, ok = rows(job.train, data.train_explanations)
            self.eval, _, eval_ok = rows(job.eval, data.eval_explanations)
            self.limit = f"critic.max_prompt_tokens {cfg.critic.max_prompt_tokens}"
        self.kept = np.flatnonzero(ok)  # training rows, by their index in the split's training part
        self.dropped = len(ok) - len(self.kept)
        if not len(self.kept):
            raise NlaInputError(explained_split(cfg, stage), f"no training row fits {self.limit} (all {len(ok)} are longer)")
        self.lengths = [lengths[i] for i in self.kept]
        self.batches = StepBatches(self.lengths, s.batch_tokens, cfg.seed)
        self.total = total_steps(s.steps, s.epochs, self.batches.per_epoch)
        self.eval_idx = np.flatnonzero(eval_ok)[: s.eval_rows]

    def step(self, step: int) -> tuple:
        """``(epoch, row indices, tokens)`` of optimiser step ``step``."""
        import numpy as np

        epoch, idx = self.batches.batch(step)
        return epoch, self.kept[np.asarray(idx)], sum(self.lengths[i] for i in idx)

    def args(self, which, idx) -> tuple:
        part = self.train if which == "train" else self.eval
        if self.stage == "av":
            prompts, responses, vectors = part
            return ([prompts[i][0] for i in idx], [prompts[i][1] for i in idx], [responses[i] for i in idx], vectors[idx])
        texts, vectors = part
        return [texts[i] for i in idx], vectors[idx]


# ---- resume -----------------------------------------------------------------------------------------
def check_resume(ckpt: Path, cfg, stage: str, data: SftData, total: int) -> int:
    """The checkpoint's step, after refusing (one line naming the field) a config, data or step count the
    stage cannot continue exactly with (``orchestrator.checkpoint.RESUME_RULES``)."""
    from nla_grpo.orchestrator.checkpoint import STATE_FILE, RunState, config_change

    where = ckpt / STATE_FILE
    state = RunState.read(ckpt)
    if state.stage != stage:
        raise NlaInputError(where, f"stage: the checkpoint is {state.stage!r}'s, this is {stage!r}")
    change = config_change(stage, state.config or {}, cfg.model_dump(mode="json"))
    if change:
        key, then, now = change
        raise NlaInputError(where, f"{key}: {then!r} when the checkpoint was written, {now!r} now; "
                                   "a resumed stage continues exactly")
    if state.data != data.job.data_fingerprint:
        raise NlaInputError(where, "the explained split differs from the one the checkpoint was trained on")
    step, planned = state.step, state.total if state.total is not None else total
    if total < step:
        raise NlaInputError(where, f"already at step {step}: sft.{stage}.steps {total} would go back (pass --steps N with N >= {step})")
    schedule = getattr(cfg.sft, stage).schedule
    if total != planned and schedule != "constant":
        raise NlaInputError(where, f"sft.{stage}.steps: the {schedule} schedule was planned for {planned} steps; {total} "
                                   "would follow another curve than either run (resume with the same count, or start a new "
                                   "run; sft.{stage}.schedule: constant can be extended)".replace("{stage}", stage))
    return step


# ---- the loop -----------------------------------------------------------------------------------------
def run_stage(stage: str, cfg, run: RunDir, data: SftData, plan: StagePlan, group, start: int,
              resume_from: Path | None, log=print) -> dict:
    import shutil
    import numpy as np

    from nla_grpo.orchestrator.checkpoint import RANKS_DIR, RunState
    from nla_grpo.sft.plan import lr_at

    s = getattr(cfg.sft, stage)
    job, total = data.job, plan.total
    name = STAGE_NAME[stage]
    log(f"[{stage}] {name}: {len(plan.kept)} training rows ({sum(plan.lengths)} tokens, {plan.batches.per_epoch} batches of "
        f">= {s.batch_tokens} tokens per epoch), {total} steps; eval on {len(plan.eval_idx)} held-out rows"
        + (f"; {plan.dropped} rows longer than {plan.limit} left out" if plan.dropped else ""))

    def evaluate() -> dict:
        if not len(plan.eval_idx):
            return {}
        out = group.call_each("evaluate", *plan.args("eval", plan.eval_idx))[0]
        if stage == "av":
            return {"eval/nll": out["nll"], "eval/tokens": out["tokens"]}
        from nla_grpo.shared.schema import fve

        return {"eval/mse": out["mse"], "eval/fve": fve(out["mse"], job.fve_baseline), "eval/scored": out["scored"]}

    def checkpoint(step: int) -> None:
        tmp = run.checkpoint_tmp(step)
        group.save(str(tmp / RANKS_DIR))
        RunState(step, config=cfg.model_dump(mode="json"), data=job.data_fingerprint, stage=stage, total=total).write(tmp)
        run.commit_checkpoint(tmp, step, cfg.checkpointing.keep_last)

    # ---- resume or start ----------------------------------------------------------------------------
    if resume_from is not None:
        group.call_each("load", str(resume_from / RANKS_DIR))
        run.truncate_logs(start)
        log(f"[resume] {name} from {resume_from.name} (step {start} of {total})")
    else:
        run.truncate_logs(-1)  # a resumed directory with no checkpoint yet: from the start (its step 0 eval too)
        first = {"step": 0, **evaluate()}
        run.append_metrics(first)
        log(f"[{stage}] step 0: " + ", ".join(f"{k} {v:.4f}" for k, v in first.items() if k in ("eval/nll", "eval/fve")))
    if start < total and run.product.exists():
        shutil.rmtree(run.product)  # training on: the finished product of a shorter run is no longer the stage's

    # ---- the loop: one batch, one optimiser step ----------------------------------------------------
    t_run = time.time()
    last: dict = {}
    for step in range(start, total):
        epoch, idx, tokens = plan.step(step)
        lr = lr_at(step, total, s.lr, s.warmup_steps, s.schedule)
        t0 = time.perf_counter()
        out = group.call_each("sft_step", *plan.args("train", np.asarray(idx)), lr)[0]
        seconds = time.perf_counter() - t0
        done = step + 1
        row = {"step": done, "epoch": epoch, "lr": lr, "loss": out["loss"], "grad_norm": out["grad_norm"],
               "skipped": out["skipped"], "rows": len(idx), "tokens": tokens, "time/step": seconds,
               "sft/tokens_per_s": tokens / seconds, "sft/tflops_executed": out["tflops_executed"], "wall_s": time.time() - t_run}
        if (s.eval_every and done % s.eval_every == 0) or done == total:
            row.update(evaluate())
        run.append_metrics(row)
        last = row
        if done % cfg.logging.every == 0 or done == total or "eval/nll" in row or "eval/fve" in row:
            extra = "".join(f", {k} {row[k]:.4f}" for k in ("eval/nll", "eval/fve") if k in row)
            log(f"[{stage}] step {done}/{total}: loss {row['loss']:.4f}, lr {lr:.2e}, {row['sft/tokens_per_s']:.0f} tokens/s"
                + extra)
        if (s.checkpoint_every and done % s.checkpoint_every == 0) or done == total:
            checkpoint(done)

    # ---- the product --------------------------------------------------------------------------------
    # atomic: a finished product is replaced whole, never half-written
    group.wait_all([group.leader.export.remote(str(run.product))])
    log(f"[{stage}] wrote {run.product}")
    return last


# ---- the command --------------------------------------------------------------------------------------
def run_sft(stage: str, config: str | None, run_dir: str | None, resume: str | None, steps: int | None,
            overrides: list[str], log=print) -> dict:
    """``nla-grpo sft av|ar``: a new stage in ``run_dir``, or the one in ``resume`` continued, through the one run
    lifecycle (``orchestrator.lifecycle``). Everything that can be checked (config, data, the plan, a resume's
    agreement with its checkpoint) is checked before any actor starts."""
    from nla_grpo.orchestrator.lifecycle import open_run, write_run_plots
    from nla_grpo.orchestrator.placement import check_run_dir_visible
    from nla_grpo.shared.ray_cluster import start_ray

    start = open_run(stage, config, run_dir, resume, list(overrides) + ([f"sft.{stage}.steps={steps}"] if steps is not None else []),
                     log=log)
    if not start.new and start.resume_from is None:
        log(f"[resume] {start.path} has no checkpoint yet: starting from step 0")
    # ---- the data and the plan --------------------------------------------------------------------
    data = load_data(start.cfg, stage, log=log)
    scfg = data.job.cfg  # what the ranks build from: a fresh adapter / critic (stage_config)
    plan = StagePlan(stage, data, scfg)
    first = check_resume(start.resume_from, scfg, stage, data, plan.total) if start.resume_from is not None else 0
    run = start.commit(start.cfg)
    if not start.new and first == plan.total and run.product.is_dir():
        log(f"[{stage}] {run.path} is at step {first} of {plan.total} and its product is written: nothing to do")
        last = next((r for r in reversed(run.read_metrics()) if "loss" in r), {"step": first})
        return dict(last, product=str(run.product))
    log(f"[run] {run.path}")
    # ---- the ranks ----------------------------------------------------------------------------------
    with start.running():
        group, pgs = None, []
        try:
            start_ray()
            check_run_dir_visible(run.path)
            try:
                group, pgs = start_ranks(scfg, stage, data.job.spec)
                group.join()
            except BaseException as exc:
                from nla_grpo.orchestrator.driver import startup_error

                raise startup_error(exc) from None
            last = run_stage(stage, scfg, run, data, plan, group, first, start.resume_from, log=log)
        finally:
            stop_ranks(group, pgs)  # before a failed new stage's directory is removed: no rank writes into it
            write_run_plots(run, log)
    return dict(last, product=str(run.product))


def done_line(stage: str, last: dict) -> str:
    """The line a finished stage ends with: its product, last step and score, and the config field that takes it."""
    key = "eval/nll" if stage == "av" else "eval/fve"
    use = "learner.adapter_init" if stage == "av" else "critic.checkpoint"
    return (f"[done] {last['product']}: step {last.get('step', '-')}, {key} {last.get(key, float('nan')):.4f}; "
            f"use it with {use}={last['product']}")

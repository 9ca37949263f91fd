"""``nla-grpo train``: an RL run through the one run lifecycle (``orchestrator.lifecycle``): the job prepared and
resolved, the judge asked once, Ray and the services started (after the colocated memory plan), the driver's loop,
and on the way out the services stopped and the plots written."""
from __future__ import annotations

import time
from pathlib import Path


def run_rl(config=None, run_dir=None, resume=None, steps: int | None = None, overrides=()) -> int:
    """``nla-grpo train``: a new RL run from ``config`` (in ``run_dir``, or a dated one under runs/) or ``resume`` of
    one; ``steps`` sets ``grpo.steps`` and ``overrides`` are ``--set`` lines. Starts Ray and the services, trains, and
    returns 0; a bad input raises ``NlaInputError``."""
    from nla_grpo.orchestrator.job import check_resume, check_resume_overrides, prepare_job
    from nla_grpo.orchestrator.lifecycle import open_run
    from nla_grpo.shared.errors import NlaInputError

    overrides = list(overrides)
    changed = tuple(check_resume_overrides(overrides)) if resume is not None else ()
    start = open_run("rl", config, run_dir, resume, overrides + ([f"grpo.steps={steps}"] if steps is not None else []),
                     log=lambda m: print(m, flush=True))
    resume_from = start.resume_from
    if resume_from is not None:
        done = int(resume_from.name.removeprefix("step_"))
        if start.cfg.grpo.steps <= done:
            raise NlaInputError(start.path, f"already at step {done} (grpo.steps {start.cfg.grpo.steps}): pass --steps N "
                                            f"with N > {done} to continue it")
    job = prepare_job(start.cfg)
    _start_judge(job)
    if resume_from is not None:
        check_resume(resume_from, job.cfg, job, start.path / "config.yaml", changed)
    run = start.commit(job.cfg)  # the config as resolved (shared.resolve)
    if not start.new and resume_from is None:
        print(f"[resume] {run.path} has no checkpoint yet: starting from step 1", flush=True)
    print(f"[run] {run.path}")
    return _run_services(job, start)


def _start_judge(job) -> None:
    """The judge of the enabled evals, asked once before anything starts: down, or refusing the key, is one line."""
    if job.evals:
        from nla_grpo.evals.judges import Judge

        job.judge = Judge(job.cfg.evals.judge)
        job.judge.check()
        print(f"[evals] judge {job.judge.backend}:{job.cfg.evals.judge.model} at {job.judge.base_url} answers", flush=True)


def _log_plots(wandb_run, plots: Path) -> None:
    """The run's PNG plots into its wandb run, as images under ``plots/``."""
    import wandb

    images = {f"plots/{png.stem}": wandb.Image(str(png)) for png in sorted(plots.glob("*.png"))}
    if images:
        wandb_run.log(images)


def _run_services(job, start) -> int:
    from nla_grpo.orchestrator.driver import stop_on_signals, train
    from nla_grpo.orchestrator.lifecycle import write_run_plots
    from nla_grpo.orchestrator.placement import check_run_dir_visible, start_ray, start_services, stop_services

    cfg, run = job.cfg, start.run
    wandb_run = None
    if cfg.logging.wandb != "disabled":
        import wandb

        wandb_run = wandb.init(project=cfg.logging.wandb_project, mode=cfg.logging.wandb, dir=str(run.path),
                               config=cfg.model_dump(mode="json"), name=run.path.name)
    with start.running():
        start_ray()
        check_run_dir_visible(run.path)
        print(f"[ray] starting services (placement {cfg.placement.mode}, rollout backend {cfg.rollout.backend})", flush=True)
        stop_on_signals()
        services = None
        try:
            _plan_memory(job, run)
            try:
                asked = time.time()
                services = start_services(job.cfg, job.spec)
                services.asked_at = asked
            except BaseException as exc:
                from nla_grpo.orchestrator.driver import startup_error

                raise startup_error(exc) from None
            last = train(job, run, services, start.resume_from, log=lambda m: print(m, flush=True), wandb_run=wandb_run)
        finally:
            stop_services(services)  # before a failed new run's directory is removed: no service writes into it
            write_run_plots(run)
            if wandb_run is not None:
                _log_plots(wandb_run, run.plots)
                wandb_run.finish()
    print(f"[done] {run.path}: step {last.get('step', '-')}, reward {last.get('reward_mean', float('nan')):+.3f}, "
          f"fve {last.get('fve', float('nan')):+.3f}")
    return 0


def _plan_memory(job, run) -> None:
    """A colocated vLLM run on this node's GPU: the memory plan per phase, printed and kept as ``memory_plan.json`` in
    the run directory; a job that cannot fit is refused here, before any actor starts."""
    cfg = job.cfg
    if cfg.placement.mode != "colocated" or cfg.rollout.backend != "vllm":
        return
    from nla_grpo.orchestrator.memory_budget import gpu_total_bytes, plan_colocated, summary
    from nla_grpo.shared.fileio import write_json

    total = gpu_total_bytes()
    if total is None:
        return
    plan = plan_colocated(job.cfg, job.spec, total)
    print(summary(plan.table, total), flush=True)
    write_json(run.path / "memory_plan.json", plan.as_json())

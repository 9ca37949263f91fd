"""``nla-grpo train``: one RL run's lifecycle around the driver's loop. A new run or a resumed one (its config, lock,
durable-storage check), the judge asked once, Ray and the services started (after the colocated memory plan), the
loop, and on the way out the services stopped, the plots written, and a new run that failed before its first step
removed so the same command works again."""
from __future__ import annotations

import time
from pathlib import Path


def run_rl(config=None, run_dir=None, resume=None, steps: int | None = None, overrides=()) -> int:
    """``nla-grpo train``: a new RL run from ``config`` (in ``run_dir``, or a dated one under runs/) or ``resume`` of
    one; ``steps`` sets ``grpo.steps`` and ``overrides`` are ``--set`` lines. Starts Ray and the services, trains, and
    returns 0; a bad input raises ``NlaInputError``."""
    from nla_grpo.shared.config import load_config
    from nla_grpo.shared.errors import NlaInputError

    from nla_grpo.orchestrator.job import absolute_paths, prepare_job
    from nla_grpo.orchestrator.run_dir import RunDir
    from nla_grpo.shared.ray_cluster import check_durable

    overrides = list(overrides)
    with_steps = overrides + ([f"grpo.steps={steps}"] if steps is not None else [])
    if (resume is None) == (config is None):
        raise NlaInputError("train", "expected either CONFIG.yaml or --resume RUN_DIR")
    if resume is not None:
        from nla_grpo.orchestrator.job import check_resume_overrides

        if run_dir:
            raise NlaInputError("train", "--resume continues the run in its own directory: --run-dir cannot be combined with it")
        changed = tuple(check_resume_overrides(overrides))
        check_durable(resume, given=True)
        run = RunDir.open(resume)
        run.lock()
        cfg = run.config(with_steps)
        resume_from = run.loadable_checkpoint(log=lambda m: print(m, flush=True))
        done = int(resume_from.name.removeprefix("step_")) if resume_from is not None else 0
        if cfg.grpo.steps <= done:
            raise NlaInputError(run.path, f"already at step {done} (grpo.steps {cfg.grpo.steps}): pass --steps N with "
                                          f"N > {done} to continue it")
        job = prepare_job(cfg)
        _start_judge(job)
        if resume_from is not None:
            from nla_grpo.orchestrator.job import check_resume

            check_resume(resume_from, job.cfg, job, run.path / "config.yaml", changed)
        run.save_config(job.cfg)  # the config as resolved (shared.resolve)
        if resume_from is None:
            print(f"[resume] {run.path} has no checkpoint yet: starting from step 1", flush=True)
    else:
        cfg = absolute_paths(load_config(config, with_steps), Path.cwd())
        given = run_dir is not None
        run_dir = run_dir or f"runs/{Path(config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        check_durable(run_dir, given=given)
        RunDir.check_new(run_dir)
        job = prepare_job(cfg)
        _start_judge(job)
        run = RunDir.create(run_dir, job.cfg)  # the config as resolved (shared.resolve)
        run.lock()
        resume_from = None
    print(f"[run] {run.path}")
    return _run_services(job, run, resume_from)


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


def _run_services(job, run, resume_from) -> int:
    from nla_grpo.orchestrator.driver import stop_on_signals, train
    from nla_grpo.orchestrator.placement import check_run_dir_visible, start_ray, start_services, stop_services
    from nla_grpo.orchestrator.plot import write_plots
    from nla_grpo.shared.errors import NlaInputError

    cfg = job.cfg
    wandb_run = None
    if cfg.logging.wandb != "disabled":
        import wandb

        wandb_run = wandb.init(project=cfg.logging.wandb_project, mode=cfg.logging.wandb, dir=str(run.path),
                               config=cfg.model_dump(mode="json"), name=run.path.name)
    start_ray()
    try:
        check_run_dir_visible(run.path)
    except NlaInputError:
        if resume_from is None:  # a new run leaves nothing behind
            import shutil

            shutil.rmtree(run.path, ignore_errors=True)
        raise
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
        last = train(job, run, services, resume_from, log=lambda m: print(m, flush=True), wandb_run=wandb_run)
    except BaseException:
        if resume_from is None and not any(r.get("step", 0) > 0 for r in run.read_metrics()) and not run.list_checkpoints():
            import shutil

            # a new run that failed before its first step (its step-0 eval aside) leaves nothing behind: the same
            # command works again
            shutil.rmtree(run.path, ignore_errors=True)
        raise
    finally:
        stop_services(services)
        if run.path.is_dir() and run.read_metrics():
            try:
                print(f"[plot] {write_plots(run.path)}")
            except NlaInputError as exc:  # the run's own outcome matters more than its plot
                print(f"[plot] not written: {exc}")
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

"""The GRPO driver: one controller, the loop read top to bottom.

Per step: batch → rollout → extract → score → reward → advantages → learner update → critic step →
adapter push → log → eval → checkpoint. Services are Ray actors (``orchestrator.placement``); the loop is
the same in every placement mode. With ``grpo.overlap_rollout`` the next step's rollout is launched
right after the rewards and runs during the update (``orchestrator.rollout_feed``); its remaining wait is
counted in ``time/rollout``.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from nla_grpo.orchestrator.groups import RankFailure
from nla_grpo.orchestrator.health import HealthWatch, empty_share
from nla_grpo.orchestrator.job import Job
from nla_grpo.learner.reward import explanation_for, rewards_for
from nla_grpo.orchestrator.checkpoint import CRITIC_DIR, LEARNER_DIR, RunState
from nla_grpo.orchestrator.rollout_feed import RolloutFeed, rollout, step_seed
from nla_grpo.orchestrator.metrics import StepTimeline, eval_metrics, eval_table, judged_tables, pareto_chart, sample_metrics
from nla_grpo.orchestrator.run_dir import RunDir
from nla_grpo.orchestrator.weight_push import AdapterPush
from nla_grpo.shared.data import ShuffledOrder, make_order, order_from_state
from nla_grpo.shared.resolve import evaluates_at_start
from nla_grpo.shared.types import PromptRequest

TIMING_KEYS = ("time/rollout", "time/score", "time/update", "time/critic", "time/push", "time/sleep", "time/eval", "time/checkpoint", "wall_s", "elapsed_s")


class StepError(RuntimeError):
    """A failure inside the loop, reported as one line with the step and phase."""


class StepInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM during the run, with the step and phase it stopped in."""


_received: list[str] = []  # the signals the CLI's handler took, in order


def note_signal(name: str) -> None:
    """Called by the CLI's SIGINT / SIGTERM handler before it raises ``KeyboardInterrupt(name)``."""
    _received.append(name)


def interrupted_by(exc: BaseException) -> str:
    """Which signal stopped the run: the interrupt's own argument, else the last signal the handler took
    (a signal that lands while the driver waits inside Ray comes back as a bare ``KeyboardInterrupt()``)."""
    if exc.args and isinstance(exc.args[0], str) and exc.args[0].startswith("SIG"):
        return exc.args[0]
    return _received[-1] if _received else "SIGINT"


def startup_error(exc: BaseException) -> BaseException:
    """A failure while the services start, as one line: a dead actor by its class and its constructor's
    cause (``shared.actors`` carries it), anything else by its innermost cause."""
    import ray.exceptions

    from nla_grpo.shared.errors import actor_class, actor_death, one_line

    if isinstance(exc, KeyboardInterrupt):
        return StepInterrupted(f"starting the services: interrupted ({interrupted_by(exc)})")
    if isinstance(exc, ray.exceptions.RayActorError):
        return StepError(f"starting the services: {actor_class(exc) or 'a service actor'} died: {actor_death(exc)}")
    return StepError(f"starting the services: {one_line(exc)}")


def _step_error(exc: BaseException, step: int, phase: str, services) -> BaseException:
    """Any failure of a step (or of the start before it) as one line: the step (``step``, counted from 1 as
    everywhere a user sees it), the phase, which service for a dead actor, and the innermost cause's own text."""
    import ray.exceptions

    from nla_grpo.shared.errors import actor_death, one_line

    where = f"step {step} ({phase})"
    if isinstance(exc, (StepError, StepInterrupted)) and str(exc).startswith("step "):
        return exc
    if isinstance(exc, KeyboardInterrupt):
        return StepInterrupted(f"{where}: interrupted ({interrupted_by(exc)})")
    if isinstance(exc, (StepError, RankFailure)):
        return StepError(f"{where}: {exc}")
    if isinstance(exc, ray.exceptions.RayActorError):
        who = services.name_of(getattr(exc, "actor_id", None)) if hasattr(services, "name_of") else None
        return StepError(f"{where}: a service actor died{f' ({who})' if who else ''}: {actor_death(exc)}")
    return StepError(f"{where}: {one_line(exc)}")


def clock(seconds: float) -> str:
    """``seconds`` as H:MM:SS."""
    s = int(round(max(seconds, 0.0)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def progress(elapsed: float, done: int, left: int) -> str:
    """The step line's tail: time since this process started stepping, seconds per step so far, and the
    time the ``left`` steps would take at that pace."""
    per = elapsed / max(done, 1)
    return f"{clock(elapsed)} elapsed, {per:.2f} s/step, eta {clock(per * left)}"


def _requests(job: Job, rows, prompt_index, idx) -> list[PromptRequest]:
    import torch

    out = []
    for i in idx:
        ids, site = job.prompt_ids[int(prompt_index[i])]
        out.append(PromptRequest(int(rows.row_ids[i]), list(ids), site, torch.from_numpy(rows.activations[i].copy())))
    return out


def _score(services, job: Job, samples, vectors):
    """Explanations, critic mses and rewards for a list of samples."""

    cfg = job.cfg
    expl = [explanation_for(s.text, s.finish_reason, s.marker_echo, cfg.rollout.cap_is_failure) for s in samples]
    mses = services.critic.score(expl, vectors)
    rewards = rewards_for(mses, cfg.grpo.reward_kind, cfg.grpo.failed_reward)
    return expl, mses, rewards


def _on_engines(services, method: str) -> float:
    """Call ``method`` (``sleep`` / ``wake_up``) on every engine and wait; returns seconds spent."""
    import ray

    t = time.time()
    ray.get([getattr(eng, method).remote() for eng in services.rollouts])
    return time.time() - t


def _evaluate(services, job: Job, step: int, run: RunDir, log) -> tuple[dict, list[dict]]:
    """The held-out eval: its metrics, and one record per prompt (also appended to samples.jsonl)."""
    import torch

    cfg = job.cfg
    idx = list(range(min(cfg.logging.eval_prompts, len(job.eval))))
    requests = _requests(job, job.eval, job.prompt_index_eval, idx)
    samples = rollout(services.rollouts, requests, seed=step_seed(cfg.seed, 1_000_000 + step))
    g = cfg.rollout.group_size
    vectors = torch.from_numpy(np.repeat(job.eval.activations[idx], g, axis=0))
    expl, mses, rewards = _score(services, job, samples, vectors)
    out = eval_metrics(rewards, mses, job.fve_baseline, expl)
    records = []
    for j, i in enumerate(idx):
        s = samples[j * g]
        records.append({"step": step + 1, "row_id": int(job.eval.row_ids[i]), "doc_id": job.eval.doc_ids[i],
                        "reward": rewards[j * g], "mse": mses[j * g], "explanation": expl[j * g], "text": s.text})
    run.append_samples(records)
    log(f"  [eval@{step + 1}] reward {out['eval/reward_mean']:+.3f} | fve {out['eval/fve']:+.3f} | ext {out['eval/extraction_rate']:.0%} "
        f"| non-empty {out['eval/nonempty_rate']:.0%} | {out['eval/explanation_chars']:.1f} chars ({len(samples)} samples)")
    for r in records[: cfg.logging.samples_printed]:
        log(f"    row {r['row_id']} r={r['reward']:+.3f}: {str(r['explanation'])[:120]!r}")
    return out, records


def _judged_evals(services, job: Job, step: int, run: RunDir, log) -> tuple[dict, list[dict]]:
    """The judged evals (``evals.tasks``) at an eval step: one sample per item from the current adapter
    (the first of its group), its explanation, the judge's verdict."""
    import torch

    from nla_grpo.evals.tasks import run_evals

    cfg, g = job.cfg, job.cfg.rollout.group_size

    def explanations_for(ev):
        base = 10_000_000 * (1 + [e.id for e in job.evals].index(ev.id))  # sampling seeds apart from the eval's rows
        requests = [PromptRequest(base + j, list(it.prompt_ids), it.site, torch.from_numpy(it.vector.copy()))
                    for j, it in enumerate(ev.items)]
        samples = rollout(services.rollouts, requests, seed=step_seed(cfg.seed, 2_000_000 + step))
        firsts = [samples[j * g] for j in range(len(requests))]
        return [explanation_for(s.text, s.finish_reason, s.marker_echo, cfg.rollout.cap_is_failure) for s in firsts]

    metrics, records = run_evals(job.evals, job.judge, explanations_for, step + 1)
    run.append_samples(records)
    shown = " | ".join(f"{k.removeprefix('eval/')} {v:.3g}" for k, v in metrics.items()
                       if k.endswith(("hallucinations_mean", "clean_rate", "captures_quirk_rate", "judge_failures")))
    log(f"  [evals@{step + 1}] {shown}")
    return metrics, records


def _write_checkpoint(services, run: RunDir, order: ShuffledOrder, feed: RolloutFeed, step: int, version: int, job: Job) -> Path:
    """Critic first, then the policy, then the training state (with any rollout in flight), into a
    temporary directory.

    The caller commits it (renames it into place) only after the step's metrics are written, so a
    kill in between resumes from the previous checkpoint and redoes the step with its log line.
    What never changes is not copied each time (unless ``checkpointing.self_contained``): the reference
    adapter is written once into the run directory and a frozen critic is the one the config builds;
    the checkpoint records their SHA-256.
    """
    from nla_grpo.critic.checkpoint import FROZEN_RECORD, write_frozen_record

    cfg = job.cfg
    tmp = run.checkpoint_tmp(step)
    by_reference = not cfg.checkpointing.self_contained
    if by_reference and not cfg.critic.train:
        write_frozen_record(tmp / FROZEN_RECORD, cfg.critic.checkpoint)
    else:
        services.critic.save(str(tmp / CRITIC_DIR))
    if by_reference:
        if not run.frozen_reference.is_dir():
            services.learner.save_reference(str(run.frozen_reference))
        services.learner.save(str(tmp / LEARNER_DIR), str(run.frozen_reference))
    else:
        services.learner.save(str(tmp / LEARNER_DIR))
    feed.save(tmp)
    # the config and the data it was written with: resume refuses to continue on anything else
    RunState(step, order.state(), version, cfg.model_dump(mode="json"), job.data_fingerprint).write(tmp)
    return tmp


def _held_once_up(cfg, services, run) -> str | None:
    """On a GPU: what the learner's and the critic's torch hold once up (their loading's cache given back), beside
    the memory plan's figures, kept as ``memory_held.json`` in the run directory; the line to log, or None."""
    import json

    import ray

    from nla_grpo.orchestrator.memory_budget import held_once_up
    from nla_grpo.shared.fileio import write_json

    if cfg.placement.mode == "cpu":
        return None
    learner, critic = ray.get([services.learner.leader.gpu_memory.remote(), services.critic.leader.gpu_memory.remote()])
    plan_file = run.path / "memory_plan.json"
    planned = json.loads(plan_file.read_text()) if plan_file.is_file() else None
    table, line = held_once_up({"learner": learner, "critic": critic}, planned)
    if table:
        write_json(run.path / "memory_held.json", table)
    return line


def resolve_sleep(cfg, learner, log=print) -> bool:
    """``rollout.sleep_during_update: auto`` left to the start: decided by ``shared.resolve.sleep_at_start`` from the
    micro-batch budget the learner would plan now, with the services up and the engines awake; logged once."""
    from nla_grpo.shared.resolve import sleep_at_start

    sleep, line = sleep_at_start(cfg, *learner.planned_tokens())
    log(line)
    return sleep


def train(job: Job, run: RunDir, services, resume_from: Path | None = None, log=print, wandb_run=None) -> dict:
    """Run steps until ``cfg.grpo.steps``; returns the last metrics row."""
    import torch

    from nla_grpo.learner.grpo import group_advantages

    import ray

    cfg = job.cfg
    P, G = cfg.grpo.prompts_per_step, cfg.rollout.group_size
    overlap, sleep = cfg.grpo.overlap_rollout, cfg.rollout.sleep_during_update
    push = AdapterPush(services.learner.leader, services.rollouts)  # rank 0 exports for every rank
    order = make_order(cfg.data.order, len(job.train), cfg.seed)
    start, phase = 0, "resume"
    try:
        if resume_from is not None:
            state = RunState.read(resume_from)
            if (resume_from / CRITIC_DIR).is_dir():  # else a frozen critic: the one the config built (checked at start-up)
                services.critic.load(str(resume_from / CRITIC_DIR))
            services.learner.load(str(resume_from / LEARNER_DIR))
            order = order_from_state(state.order)
            start = state.step
            log(f"[resume] from {resume_from}: {start} steps done, continuing with step {start + 1}")
        feed = RolloutFeed(services.rollouts, lambda idx: _requests(job, job.train, job.prompt_index_train, idx), order, P, cfg.seed)
        if resume_from is not None:
            feed.restore(resume_from)  # the rollout that was in flight at the checkpoint, if any
        run.truncate_logs(start)
        phase = "push"
        version = push()
        if sleep == "auto":
            phase = "plan"
            sleep = resolve_sleep(cfg, services.learner, log)
        phase = "describe"
        engines = ray.get([eng.describe.remote() for eng in services.rollouts])
        held = _held_once_up(cfg, services, run)
    except BaseException as exc:
        raise _step_error(exc, start + 1, phase, services) from None
    for line in dict.fromkeys(engines):  # each kind of engine once
        log(f"[engine] {line}")
    if held:
        log(held)
    asked = getattr(services, "asked_at", None)  # the engines and learner rank 0 are up once the first push is through
    log(f"[push] adapter v{version} on {len(services.rollouts)} engine(s)"
        + (f"; engines and learner up {time.time() - asked:.1f} s after the services were asked for" if asked else ""))
    # ---- step 0: the held-out eval before any update (what a warm start brings, and RL must keep) ----
    health = HealthWatch.from_config(cfg)
    if start == 0 and evaluates_at_start(cfg):
        try:
            summary, _ = _evaluate(services, job, -1, run, log)
        except BaseException as exc:
            raise _step_error(exc, 0, "eval", services) from None
        run.append_metrics({"step": 0, "adapter_version": version, **summary})
        health.step0_fve = summary["eval/fve"]
    else:  # a resumed run keeps its own step 0
        health.step0_fve = next((r.get("eval/fve") for r in run.read_metrics() if r.get("step") == 0), None)
    t_run = time.time()
    last: dict = {}
    step, phase = start, "start"
    timeline = StepTimeline()
    try:
        for step in range(start, cfg.grpo.steps):
            t0 = time.time()
            # ---- batch + rollout (already in flight when overlapping) ----
            phase = timeline.mark("rollout")
            t = time.time()
            if feed.pending is None:
                feed.launch(step, version)
            got = feed.collect(step)
            samples, idx = got.samples, got.idx
            stale = {s.adapter_version for s in samples} - {got.version}
            if stale:
                raise StepError(f"samples came from adapter version(s) {sorted(stale)}, expected {got.version}: the weight push did not arrive")
            t_rollout = time.time() - t
            vectors = torch.from_numpy(np.repeat(job.train.activations[idx], G, axis=0))
            group_ids = torch.arange(P).repeat_interleave(G)

            # ---- extract, score, reward ----
            phase = timeline.mark("score")
            t = time.time()
            expl, mses, rewards = _score(services, job, samples, vectors)
            t_score = time.time() - t

            # ---- advantages ----
            adv = group_advantages(torch.tensor(rewards, dtype=torch.float32), group_ids, eps=cfg.grpo.adv_eps)

            # ---- overlap: the next step's rollout starts now, on the adapter the engines hold ----
            # (on the last step too: the final checkpoint keeps it, so `--resume --steps` more is exact)
            if overlap:
                feed.launch(step + 1, version)

            # ---- update (vLLM asleep meanwhile, when configured) ----
            phase = "update"
            t_sleep = 0.0
            if sleep:
                timeline.mark("sleep")
                t_sleep = _on_engines(services, "sleep")
            timeline.mark("update")
            t = time.time()
            upd = services.learner.update(samples, adv.tolist(), vectors)
            t_update = time.time() - t
            if upd.get("skipped"):
                log(f"step {step + 1}: optimiser step skipped (non-finite loss or gradient norm, or no usable sample)")

            # ---- critic co-training (after the rewards it produced were computed) ----
            phase = timeline.mark("critic")
            t = time.time()
            crit = {}
            if cfg.critic.train and not upd.get("skipped"):
                keep = [i for i, e in enumerate(expl) if e is not None]
                if keep:
                    crit = services.critic.train_step([expl[i] for i in keep], vectors[keep])
            t_critic = time.time() - t

            # ---- push (after the overlapped rollout, whose remaining wait counts as rollout time) ----
            phase = "rollout"
            timeline.mark("rollout_wait")  # the overlapped rollout's remaining time (none without overlap)
            t = time.time()
            feed.wait()
            t_rollout += time.time() - t
            phase = "push"
            if sleep:
                timeline.mark("wake_up")
                t_sleep += _on_engines(services, "wake_up")
            timeline.mark("push")
            t = time.time()
            if not upd.get("skipped"):
                version = push()
            t_push = time.time() - t

            # ---- log ----
            row = {
                "step": step + 1,  # steps are counted from 1 wherever a user sees them: step N's checkpoint is step_N
                **sample_metrics(rewards, mses, adv, [s.text for s in samples], job.fve_baseline, job.fve_baseline_meannorm),
                "length_rate": sum(s.finish_reason == "length" for s in samples) / len(samples),
                "marker_echo_rate": sum(bool(s.marker_echo) for s in samples) / len(samples),
                "mean_resp_len": float(np.mean([len(s.response_ids) for s in samples])),
                "empty_rate": empty_share(expl),
                "adapter_version": version,
                "time/rollout": t_rollout, "time/score": t_score, "time/update": t_update,
                "time/critic": t_critic, "time/push": t_push, "time/sleep": t_sleep,
            }
            row.update({k: v for k, v in upd.items() if k != "skipped"})
            row["skipped"] = bool(upd.get("skipped", False))
            row.update(crit)

            # ---- eval ----
            phase = timeline.mark("eval")
            t = time.time()
            records, judged_records = None, None
            if cfg.logging.eval_every and ((step + 1) % cfg.logging.eval_every == 0 or step + 1 == cfg.grpo.steps):
                summary, records = _evaluate(services, job, step, run, log)
                row.update(summary)
                if job.evals:
                    judged, judged_records = _judged_evals(services, job, step, run, log)
                    row.update(judged)
            row["time/eval"] = time.time() - t

            # ---- checkpoint ----
            phase = timeline.mark("checkpoint")
            t = time.time()
            every = cfg.checkpointing.every
            pending = None
            if (every and (step + 1) % every == 0) or step + 1 == cfg.grpo.steps:
                pending = _write_checkpoint(services, run, order, feed, step + 1, version, job)
            row["time/checkpoint"] = time.time() - t
            for line in health.check(row):
                log(line)
            row["wall_s"] = time.time() - t0
            row["elapsed_s"] = time.time() - t_run
            run.append_metrics(row)
            run.append_timeline(timeline.row(step + 1))
            if pending is not None:
                run.commit_checkpoint(pending, step + 1, cfg.checkpointing.keep_last)
            if wandb_run is not None:
                tables = {"eval/samples": eval_table(records)} if records else {}
                if judged_records:
                    tables.update(judged_tables(judged_records))
                    tables.update(pareto_chart(run.read_metrics()))
                wandb_run.log({**row, **tables}, step=step + 1)
            if step == start or (step + 1) % cfg.logging.every == 0 or step + 1 == cfg.grpo.steps:
                log(f"step {step + 1:5d}/{cfg.grpo.steps} | r {row['reward_mean']:+.3f} | fve {row['fve']:+.3f} | "
                    f"ext {row['extraction_rate']:.0%} | kl {row.get('kl_mean', float('nan')):.4f} | "
                    f"clip {row.get('clip_frac', float('nan')):.1%} | mm {row.get('logprob_mismatch_k3', float('nan')):.1e} | "
                    f"v{version} | {row['wall_s']:.2f}s (roll {t_rollout:.2f} score {t_score:.2f} upd {t_update:.2f} "
                    f"crit {t_critic:.2f} push {t_push:.2f}) | {progress(row['elapsed_s'], step + 1 - start, cfg.grpo.steps - step - 1)}")
            last = row
    except BaseException as exc:
        raise _step_error(exc, step + 1, phase, services) from None
    return last


def stop_on_signals() -> None:
    """SIGTERM stops the run as Ctrl-C does (the driver then tears Ray down and prints one line),
    instead of Ray's default handler (a native stack dump)."""
    import signal

    def stop(signum, frame):
        note_signal(signal.Signals(signum).name)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

"""One run's lifecycle, the same for every stage (``nla-grpo train``, ``sft av``, ``sft ar``; ``pipeline`` runs them
in turn through these):

1. ``open_run``: a new run (its config read, its directory checked to be new and on durable storage) or a resumed one
   (its directory opened and locked, its stage checked, its config read back, its newest loadable checkpoint found);
2. the stage checks what it will run (``prepare_job``, a plan) before anything is written;
3. ``RunStart.commit``: the run directory holds the resolved config from here on (a new one is created and locked);
4. ``RunStart.running``: the stage's work; a new run that fails with nothing to resume from and no step logged leaves
   no directory behind, so the same command works again;
5. ``write_run_plots`` on the way out.

The checkpoint layout and the resume rules per stage are ``orchestrator.checkpoint``'s; the files of a run
directory are ``orchestrator.run_dir``'s.
"""
from __future__ import annotations

import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from nla_grpo.orchestrator.checkpoint import RunState
from nla_grpo.orchestrator.run_dir import RunDir
from nla_grpo.shared.errors import NlaInputError

COMMAND = {"rl": "train", "av": "sft av", "ar": "sft ar"}
DIR_SUFFIX = {"rl": "", "av": "-sft-av", "ar": "-sft-ar"}  # a dated run directory's name after the config's


@dataclass
class RunStart:
    """A run about to start. ``run``: the opened and locked directory (a resume), or None until ``commit`` creates it
    (a new run); ``resume_from``: the checkpoint a resume continues from (None: from the start); ``new``: a new run."""

    stage: str
    cfg: object  # shared.config.RunConfig, as read (``commit`` writes the resolved one)
    path: Path
    run: RunDir | None
    resume_from: Path | None
    new: bool = False

    def commit(self, cfg) -> RunDir:
        """From here on the run directory holds ``cfg`` (resolved): a new run's is created and locked."""
        if self.new:
            self.run = RunDir.create(self.path, cfg, self.stage)
            self.run.lock()
        else:
            self.run.save_config(cfg)
        return self.run

    @contextmanager
    def running(self):
        """The stage's work: a new run that fails before anything worth keeping (a checkpoint, or a logged step past the
        step-0 eval) is removed. Stop the actors inside, so none writes into a removed directory."""
        try:
            yield self.run
        except BaseException:
            run = self.run
            if self.new and run is not None and not run.list_checkpoints() \
                    and not any(r.get("step", 0) > 0 for r in run.read_metrics()):
                shutil.rmtree(run.path, ignore_errors=True)
            raise


def open_run(stage: str, config, run_dir, resume, overrides=(), log=print) -> RunStart:
    """``config`` (a new run, in ``run_dir`` or a dated directory under runs/) or ``resume`` (a run directory of
    ``stage``), with ``overrides`` (``--set`` lines); refused in one line when neither or both are given."""
    from nla_grpo.shared.ray_cluster import check_durable

    command = COMMAND[stage]
    if (resume is None) == (config is None):
        raise NlaInputError(command, "expected either CONFIG.yaml or --resume RUN_DIR")
    if resume is not None:
        if run_dir:
            raise NlaInputError(command, "--resume continues the run in its own directory: --run-dir cannot be combined with it")
        check_durable(resume, given=True)
        run = RunDir.open(resume, stage)
        run.lock()
        check_stage(run)
        cfg = run.config(list(overrides))
        return RunStart(stage, cfg, run.path, run, run.loadable_checkpoint(log=log))
    from nla_grpo.orchestrator.job import absolute_paths
    from nla_grpo.shared.config import load_config

    cfg = absolute_paths(load_config(config, list(overrides)), Path.cwd())
    given = run_dir is not None
    run_dir = run_dir or f"runs/{Path(config).stem}{DIR_SUFFIX[stage]}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_durable(run_dir, given=given)
    RunDir.check_new(run_dir)
    return RunStart(stage, cfg, Path(run_dir), None, None, new=True)


def check_stage(run: RunDir) -> None:
    """A run directory of another stage is named as such (before its checkpoints are looked for)."""
    for ckpt in reversed(run.list_checkpoints()):
        try:
            got = RunState.read(ckpt).stage
        except NlaInputError:
            continue  # a damaged state: the checkpoint checks name it
        if got != run.stage:
            raise NlaInputError(run.path, f"a run directory of `{COMMAND[got]}`, not of `{COMMAND[run.stage]}`")
        return


def write_run_plots(run: RunDir | None, log=print) -> None:
    """The run's plots, where it logged anything; a plot that cannot be drawn is a line, not a failure (the run's own
    outcome matters more)."""
    from nla_grpo.orchestrator.plot import write_plots

    if run is None or not run.path.is_dir() or not run.read_metrics():
        return
    try:
        log(f"[plot] {write_plots(run.path)}")
    except NlaInputError as exc:
        log(f"[plot] not written: {exc}")

"""The run directory: resolved config, metrics.jsonl, samples.jsonl, timeline.jsonl, atomic checkpoints, plots.

A checkpoint is built in ``checkpoints/.tmp-step_NNNNNN`` and renamed into place only when complete,
so a run killed at any moment leaves either the whole checkpoint or none of it. One process at a time
writes a run directory: ``lock`` holds an OS lock on ``.lock`` for the writer's lifetime.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from nla_grpo.orchestrator.checkpoint import checkpoint_problem, is_checkpoint, required_parts
from nla_grpo.shared.config import RunConfig, build_config, dump_config, read_yaml_file, upgrade_saved_config
from nla_grpo.shared.errors import NlaInputError
from nla_grpo.shared.fileio import jsonable, write_text


LOCK_FILE = ".lock"
_HELD: list[int] = []  # lock file descriptors this process holds


def _json_safe(obj):
    """Strict JSON lines: NaN / inf become null."""
    return jsonable(obj, nonfinite=None)


PRODUCT_DIR = {"av": "adapter", "ar": "critic"}  # what a finished SFT stage leaves beside its checkpoints


class RunDir:
    """One run's directory, of any stage (``orchestrator.checkpoint.STAGES``)."""

    current: Path | None = None  # the run this process created or opened last: the CLI's resume hints name it

    def __init__(self, path: str | Path, stage: str = "rl"):
        self.path = Path(path)
        self.stage = stage
        # an SFT stage's product (adapter/ or critic/), written atomically at its end
        self.product = self.path / PRODUCT_DIR[stage] if stage in PRODUCT_DIR else None
        self.metrics = self.path / "metrics.jsonl"
        self.samples = self.path / "samples.jsonl"
        self.timeline = self.path / "timeline.jsonl"  # when each step's phases ran (unix times)
        self.checkpoints = self.path / "checkpoints"
        self.plots = self.path / "plots"
        # written once per run: checkpoints point at it (unless checkpointing.self_contained)
        self.frozen_reference = self.path / "frozen" / "reference"

    # ---- creation / resume ----
    @staticmethod
    def check_new(path: str | Path) -> None:
        """``path`` can hold a new run: absent, or an empty directory."""
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise NlaInputError(path, "expected a directory for the run, found a file")
        if path.exists() and any(path.iterdir()):
            raise NlaInputError(path, "run directory exists and is not empty (use --resume to continue it)")

    @classmethod
    def create(cls, path: str | Path, cfg: RunConfig, stage: str = "rl") -> "RunDir":
        run = cls(path, stage)
        cls.check_new(run.path)
        try:
            run.checkpoints.mkdir(parents=True, exist_ok=True)
            write_text(run.path / "config.yaml", dump_config(cfg))
        except OSError as exc:
            raise NlaInputError(run.path, f"cannot create the run directory: {exc.strerror or exc}") from None
        RunDir.current = run.path
        return run

    @classmethod
    def open(cls, path: str | Path, stage: str = "rl") -> "RunDir":
        run = cls(path, stage)
        if not (run.path / "config.yaml").is_file():
            raise NlaInputError(run.path, "not a run directory (no config.yaml)")
        RunDir.current = run.path
        return run

    def lock(self) -> None:
        """Hold the run directory's lock until this process exits; a second writer is refused with one
        line naming the holder (two writers would interleave metrics and each other's checkpoints)."""
        import fcntl
        import socket

        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise NlaInputError(self.path, f"in use by {holder}: one run directory has one writer at a time") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        _HELD.append(fd)  # released by the OS when the process ends, however it ends

    def config(self, overrides: list[str] = ()) -> RunConfig:
        path = self.path / "config.yaml"
        raw = read_yaml_file(path) or {}
        # a run saved by an older version resumes as it ran (shared.config.upgrade_saved_config)
        return build_config(upgrade_saved_config(raw) if isinstance(raw, dict) else raw, str(path), overrides)

    def save_config(self, cfg: RunConfig) -> None:
        write_text(self.path / "config.yaml", dump_config(cfg))

    # ---- logs ----
    def append_metrics(self, row: dict) -> None:
        with self.metrics.open("a") as f:
            f.write(json.dumps(_json_safe(row), sort_keys=True) + "\n")

    def append_samples(self, rows: list[dict]) -> None:
        with self.samples.open("a") as f:
            for r in rows:
                f.write(json.dumps(_json_safe(r), ensure_ascii=False) + "\n")

    def append_timeline(self, row: dict) -> None:
        with self.timeline.open("a") as f:
            f.write(json.dumps(_json_safe(row)) + "\n")

    def read_metrics(self) -> list[dict]:
        if not self.metrics.is_file():
            return []
        out = []
        for line in self.metrics.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a kill: everything after it is gone too
        return out

    def truncate_logs(self, step: int) -> None:
        """Keep the log lines of steps 1..``step`` (the checkpoint resumed from holds step ``step``'s state);
        later ones are redone after a resume."""
        for path in (self.metrics, self.samples, self.timeline):
            if not path.is_file():
                continue
            keep = []
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= step:
                        keep.append(line)
                except json.JSONDecodeError:
                    break
            write_text(path, "".join(l + "\n" for l in keep))

    # ---- checkpoints ----
    def checkpoint_tmp(self, step: int) -> Path:
        tmp = self.checkpoints / f".tmp-step_{step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def commit_checkpoint(self, tmp: Path, step: int, keep_last: int) -> Path:
        final = self.checkpoints / f"step_{step:06d}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in self.list_checkpoints()[:-keep_last] if keep_last > 0 else ():  # 0 keeps every checkpoint
            shutil.rmtree(old, ignore_errors=True)
        return final

    def list_checkpoints(self) -> list[Path]:
        if not self.checkpoints.is_dir():
            return []
        # only step_NNNNNN directories count (a stray copy such as step_000004.bak is not a checkpoint)
        done = [p for p in self.checkpoints.iterdir() if is_checkpoint(p)]
        return sorted(done, key=lambda p: int(p.name.split("_")[1]))

    def checkpoint_problem(self, ckpt: Path) -> str | None:
        """Why ``ckpt`` cannot be loaded, or None (``orchestrator.checkpoint.checkpoint_problem`` with this
        stage's parts)."""
        return checkpoint_problem(ckpt, required_parts(self.stage))

    def loadable_checkpoint(self, log=print) -> Path | None:
        """The newest checkpoint that is complete and loadable; damaged ones are skipped and named."""
        ckpts = self.list_checkpoints()
        skipped = []
        for ckpt in reversed(ckpts):
            problem = self.checkpoint_problem(ckpt)
            if problem is None:
                return ckpt
            skipped.append(f"{ckpt.name}: {problem}")
            log(f"[resume] skipping {ckpt.name}: {problem}")
        if skipped:
            raise NlaInputError(self.checkpoints, f"no loadable checkpoint ({'; '.join(skipped)})")
        return None

    def latest_checkpoint(self) -> Path | None:
        ckpts = self.list_checkpoints()
        return ckpts[-1] if ckpts else None

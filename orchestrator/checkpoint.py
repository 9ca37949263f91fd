"""A run checkpoint, ``checkpoints/step_NNNNNN/``: the one place that knows its layout, and its one writer
and reader of the run's own state.

    state.json              ``RunState``: the step, the data order, the adapter version, and the config and
                            data fingerprint it was written with (a resume refuses to continue on others)
    policy/                 the learner's checkpoint (``learner.checkpoint``)
    critic/ or critic.json  the co-trained critic's checkpoint (``critic.checkpoint``), or the record of the
                            frozen one the config builds
    pending_rollout.json    the rollout in flight (``grpo.overlap_rollout``), so a resume uses its very samples

The services write their own parts (``LearnerGroup.save``, ``CriticGroup.save``); the driver, ``import-run``,
the resume checks and the run directory go through these names and ``RunState``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from nla_grpo.learner.checkpoint import REFERENCE_RECORD
from nla_grpo.learner.checkpoint import STATE_FILE as LEARNER_STATE
from nla_grpo.shared.errors import NlaInputError

STATE_FILE = "state.json"
POLICY_DIR, CRITIC_DIR = "policy", "critic"
PENDING_FILE = "pending_rollout.json"


def required_parts() -> tuple:
    """What every checkpoint holds: each a file, or one of several (a frozen critic is a record, not a copy)."""
    from nla_grpo.critic.checkpoint import FROZEN_RECORD, META_NAME  # imports torch: only when a checkpoint is checked

    return STATE_FILE, f"{POLICY_DIR}/{LEARNER_STATE}", (f"{CRITIC_DIR}/{META_NAME}", FROZEN_RECORD)


@dataclass
class RunState:
    """``state.json``. ``config`` and ``data`` are None in checkpoints written before they were recorded;
    ``imported_from`` names the reference-trainer checkpoint an ``import-run`` converted."""

    step: int
    order: dict | None = None  # None only in a state written by hand: the driver needs it to resume
    adapter_version: int | None = None
    config: dict | None = None
    data: dict | None = None
    imported_from: str | None = None

    def write(self, ckpt: Path) -> None:
        from nla_grpo.shared.fileio import write_json

        state = asdict(self)
        if self.imported_from is None:
            del state["imported_from"]
        write_json(Path(ckpt) / STATE_FILE, state, indent=1)

    @classmethod
    def read(cls, ckpt: Path) -> "RunState":
        """The checkpoint's state; one line naming the file and the field when it is not one."""
        from nla_grpo.shared.fileio import read_json_object

        path = Path(ckpt) / STATE_FILE
        raw = read_json_object(path)
        for key, kind, needed in (("step", int, True), ("order", dict, False), ("adapter_version", int, False)):
            value = raw.get(key)
            if (value is not None or needed) and (not isinstance(value, kind) or isinstance(value, bool)):
                raise NlaInputError(path, f"{key}: expected {kind.__name__}, found {value!r}")
        for key in ("config", "data"):
            if raw.get(key) is not None and not isinstance(raw[key], dict):
                raise NlaInputError(path, f"{key}: expected an object, found {type(raw[key]).__name__}")
        return cls(step=raw["step"], order=raw.get("order"), adapter_version=raw.get("adapter_version"), config=raw.get("config"),
                   data=raw.get("data"), imported_from=raw.get("imported_from"))


def is_checkpoint(path: Path) -> bool:
    """A committed ``step_NNNNNN`` directory with its state (complete or not: see ``checkpoint_problem``)."""
    import re

    return path.is_dir() and re.fullmatch(r"step_\d{6,}", path.name) is not None and (path / STATE_FILE).is_file()


def checkpoint_problem(ckpt: Path, required: tuple | None = None) -> str | None:
    """Why ``ckpt`` cannot be loaded (a missing part of ``required``, by default ``required_parts()``; JSON that
    does not parse; a safetensors file whose header or size is wrong; a frozen file it points at that is gone or
    changed), or None. Reads headers only."""
    import json

    from safetensors import safe_open

    from nla_grpo.shared.fileio import resolve_reference

    for part in required or required_parts():
        options = (part,) if isinstance(part, str) else part
        if not any((ckpt / p).is_file() for p in options):
            return f"{' or '.join(options)} is missing"
    for f in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        rel = f.relative_to(ckpt)
        try:
            if f.suffix == ".json":
                json.loads(f.read_text(encoding="utf-8"))
            elif f.suffix == ".safetensors":
                with safe_open(str(f), framework="pt") as h:  # checks the header against the file's size
                    list(h.keys())
        except Exception as exc:  # any parse failure means "damaged"; the caller names the file
            return f"{rel} is damaged ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]})"
    for record in sorted(ckpt.rglob(REFERENCE_RECORD)):
        try:
            resolve_reference(record)
        except NlaInputError as exc:
            return f"{record.relative_to(ckpt)}: {exc.problem}"
    return None

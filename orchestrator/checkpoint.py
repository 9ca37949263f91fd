"""A run checkpoint, ``checkpoints/step_NNNNNN/``, for every stage (``rl``: ``nla-grpo train``; ``av`` / ``ar``:
``nla-grpo sft av|ar``): the one place that knows its layout, its one writer and reader of the run's own state, and
the rules a resume must keep, per stage, as data.

    state.json              ``RunState``: the stage, the step (and an SFT stage's planned total), the data order and
                            adapter version (RL), and the config and data fingerprint it was written with
    policy/                 RL: the learner's checkpoint (``learner.checkpoint``; its adapter is ``policy/policy/``)
    critic/ or critic.json  RL: the co-trained critic's checkpoint (``critic.checkpoint``), or the record of the
                            frozen one the config builds
    pending_rollout.json    RL: the rollout in flight (``grpo.overlap_rollout``), so a resume uses its very samples
    model/                  SFT: the stage's ranks' full state (a learner checkpoint for AV, a critic's for AR)

The services write their own parts (``LearnerGroup.save``, ``CriticGroup.save``, the SFT rank group); the driver,
the SFT loop, ``import-run``, the resume checks and the run directory go through these names and ``RunState``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from nla_grpo.learner.checkpoint import POLICY_ADAPTER_DIR, REFERENCE_RECORD
from nla_grpo.learner.checkpoint import STATE_FILE as LEARNER_STATE
from nla_grpo.shared.errors import NlaInputError

STAGES = ("rl", "av", "ar")
STATE_FILE = "state.json"
LEARNER_DIR, CRITIC_DIR = "policy", "critic"  # an RL checkpoint's services
RANKS_DIR = "model"  # an SFT checkpoint's ranks
PENDING_FILE = "pending_rollout.json"


def required_parts(stage: str = "rl") -> tuple:
    """What every checkpoint of ``stage`` holds: each a file, or one of several (a frozen critic is a record, not a
    copy)."""
    from nla_grpo.critic.checkpoint import FROZEN_RECORD, META_NAME  # imports torch: only when a checkpoint is checked

    if stage == "av":
        return STATE_FILE, f"{RANKS_DIR}/{LEARNER_STATE}"
    if stage == "ar":
        return STATE_FILE, f"{RANKS_DIR}/{META_NAME}"
    return STATE_FILE, f"{LEARNER_DIR}/{LEARNER_STATE}", (f"{CRITIC_DIR}/{META_NAME}", FROZEN_RECORD)


def policy_adapter(ckpt: Path) -> Path:
    """The trained verbaliser adapter of an RL checkpoint."""
    return Path(ckpt) / LEARNER_DIR / POLICY_ADAPTER_DIR


@dataclass
class RunState:
    """``state.json``. ``config`` and ``data`` are None in a state written by hand; ``total``: the steps an SFT
    stage's schedule was planned for; ``imported_from`` names the reference-trainer checkpoint an ``import-run``
    converted."""

    step: int
    order: dict | None = None  # RL: None only in a state written by hand (the driver needs it to resume)
    adapter_version: int | None = None
    config: dict | None = None
    data: dict | None = None
    imported_from: str | None = None
    stage: str = "rl"
    total: int | None = None

    def write(self, ckpt: Path) -> None:
        from nla_grpo.shared.fileio import write_json

        state = asdict(self)
        for key in ("imported_from", "total"):  # written only where they apply
            if state[key] is None:
                del state[key]
        if self.stage != "rl":  # an SFT stage has no data order or adapter version
            del state["order"], state["adapter_version"]
        write_json(Path(ckpt) / STATE_FILE, state, indent=1)

    @classmethod
    def read(cls, ckpt: Path) -> "RunState":
        """The checkpoint's state; one line naming the file and the field when it is not one."""
        from nla_grpo.shared.fileio import read_json_object

        path = Path(ckpt) / STATE_FILE
        raw = read_json_object(path)
        for key, kind, needed in (("step", int, True), ("order", dict, False), ("adapter_version", int, False),
                                  ("total", int, False)):
            value = raw.get(key)
            if (value is not None or needed) and (not isinstance(value, kind) or isinstance(value, bool)):
                raise NlaInputError(path, f"{key}: expected {kind.__name__}, found {value!r}")
        for key in ("config", "data"):
            if raw.get(key) is not None and not isinstance(raw[key], dict):
                raise NlaInputError(path, f"{key}: expected an object, found {type(raw[key]).__name__}")
        stage = raw.get("stage", "rl")
        if stage not in STAGES:
            raise NlaInputError(path, f"stage: expected one of {', '.join(STAGES)}, found {stage!r}")
        return cls(step=raw["step"], order=raw.get("order"), adapter_version=raw.get("adapter_version"), config=raw.get("config"),
                   data=raw.get("data"), imported_from=raw.get("imported_from"), stage=stage, total=raw.get("total"))


# ---- what a resume must keep, per stage ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ResumeRule:
    """Which config fields (dotted; a prefix ending in ``.`` covers a section) a resumed run may change: everything
    but ``keeps`` (an SFT stage: the fields its result depends on), or only ``may_change`` (RL, whose result depends
    on nearly every field)."""

    may_change: tuple = ()
    keeps: tuple | None = None

    def fixed(self, key: str) -> bool:
        if self.keeps is not None:
            return key.startswith(self.keeps)
        return not key.startswith(self.may_change)


RESUME_RULES = {
    # how long it runs, what it logs and keeps, where its files live (the data's content is checked by its fingerprint)
    "rl": ResumeRule(may_change=("grpo.steps", "logging.", "sft.", "evals.", "checkpointing.", "model.path", "data.parquet",
                                 "data.sidecar", "critic.checkpoint", "learner.adapter_init", "learner.reference_adapter")),
    # what the stage's adapter or critic depends on (its step count and cadences may change; files may move)
    "av": ResumeRule(keeps=("seed", "model.dtype", "model.quantization", "injection.", "prompts.", "learner.", "rollout.prefill",
                            "rollout.extra_stop_tokens", "data.eval_fraction", "data.max_rows", "sft.av.lr",
                            "sft.av.warmup_steps", "sft.av.schedule", "sft.av.epochs", "sft.av.batch_tokens",
                            "placement.learner_workers")),
    "ar": ResumeRule(keeps=("seed", "model.dtype", "model.quantization", "critic.num_layers", "critic.lora_r",
                            "critic.lora_alpha", "critic.add_bos", "critic.optimizer", "critic.max_grad_norm",
                            "critic.micro_batch", "critic.max_prompt_tokens", "data.eval_fraction", "data.max_rows",
                            "sft.ar.lr", "sft.ar.warmup_steps", "sft.ar.schedule", "sft.ar.epochs", "sft.ar.batch_tokens",
                            "placement.critic_workers")),
}


def flat_config(d: dict, prefix: str = "") -> dict:
    """A config dump as ``{dotted.field: value}``."""
    out = {}
    for k, v in d.items():
        out.update(flat_config(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def config_change(stage: str, then: dict, now: dict, allowed: tuple = ()) -> tuple[str, object, object] | None:
    """The first field (sorted) that differs between the config a checkpoint was written with and this resume's and
    that ``stage``'s rule keeps fixed, as ``(field, then, now)``; ``allowed``: fields this resume changes on purpose."""
    rule = RESUME_RULES[stage]
    then, now = flat_config(then), flat_config(now)
    for key in sorted(set(now) | set(then)):
        if rule.fixed(key) and key not in allowed and now.get(key) != then.get(key):
            return key, then.get(key), now.get(key)
    return None


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

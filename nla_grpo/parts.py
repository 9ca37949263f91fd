"""Where a trained NLA's parts are: the verbaliser (a LoRA adapter on the subject model, or a merged model), the
reconstructor (a critic checkpoint), the run config that says how they were trained (prompts, injection,
sampling, stops), the data sidecar (marker, templates, layer, scales) and the FVE baseline.

``locate`` takes what a user points at:

    a pipeline run       DIR/pipeline.json and DIR/rl/ (RL's newest checkpoint)
    an RL run            DIR/config.yaml and DIR/checkpoints/step_N/ (the newest loadable one)
    an exported NLA      DIR/nla_export.json (``nla_grpo.export``): a merged verbaliser and its critic

``from_parts`` takes an adapter, a critic and a data sidecar directly. Every mismatch between the parts (another
subject model, another layer or width) is one line naming the file and the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nla_grpo.shared.errors import NlaInputError

EXPORT_RECORD = "nla_export.json"


@dataclass(frozen=True)
class NlaParts:
    """Everything reading with an NLA needs, resolved to files."""

    cfg: object  # shared.config.RunConfig: model.path is the verbaliser's base (or the merged verbaliser)
    spec: object  # shared.spec.NlaSpec
    adapter: Path | None  # the verbaliser's LoRA; None when model.path is already the merged verbaliser
    critic: Path  # a critic checkpoint directory (critic_meta.json + weights)
    subject: Path  # the subject model the activations are read from
    fve_baseline: float  # the FVE denominator the NLA was evaluated with
    source: str  # what was loaded, for the log line


def _fve_baseline(run: Path, spec) -> float:
    """The baseline the run's evals divided by (its metrics), else the sidecar's ``fve_baseline.rawvar``."""
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            try:
                value = json.loads(line).get("fve_baseline")
            except json.JSONDecodeError:
                continue
            if isinstance(value, (int, float)) and value > 0:
                return float(value)
    return sidecar_baseline(spec)


def sidecar_baseline(spec, rows: int = 4000) -> float:
    """The sidecar's ``fve_baseline.rawvar``; without one, the training rows' as a run computes it (the first
    ``rows`` of the parquet the sidecar sits beside)."""
    import yaml

    from nla_grpo.shared.spec import SIDECAR_SUFFIX

    raw = yaml.safe_load(Path(spec.path).read_text(encoding="utf-8")) or {}
    value = (raw.get("fve_baseline") or {}).get("rawvar") if isinstance(raw.get("fve_baseline"), dict) else None
    parquet = Path(str(spec.path).removesuffix(SIDECAR_SUFFIX))
    if value is None and str(spec.path).endswith(SIDECAR_SUFFIX) and parquet.is_file():
        import torch

        from nla_grpo.shared.data import read_rows, split_eval
        from nla_grpo.shared.schema import fve_baselines

        train, _ = split_eval(read_rows(parquet, spec.d_model), 0.1)
        value = fve_baselines(torch.from_numpy(train.activations[:rows]), spec.mse_scale)[1]
    if not isinstance(value, (int, float)) or value <= 0:
        raise NlaInputError(spec.path, f"fve_baseline.rawvar: expected a positive number (the FVE denominator), found {value!r}")
    return float(value)


def _spec_for(cfg):
    from nla_grpo.shared.spec import load_spec, sidecar_path

    if not Path(cfg.data.parquet or "").is_file() and not cfg.data.sidecar:
        raise NlaInputError(cfg.data.parquet, "data parquet not found (the NLA's run reads its sidecar for the marker, templates and layer)")
    return load_spec(cfg.data.sidecar or sidecar_path(cfg.data.parquet))


def _checkpoint_critic(ckpt: Path, cfg) -> Path:
    from nla_grpo.critic.checkpoint import FROZEN_RECORD, META_NAME

    if (ckpt / "critic" / META_NAME).is_file():
        return ckpt / "critic"
    if (ckpt / FROZEN_RECORD).is_file() and cfg.critic.checkpoint:
        return Path(cfg.critic.checkpoint)  # a frozen critic: the checkpoint records the one the config names
    raise NlaInputError(ckpt, f"no critic: expected critic/{META_NAME} or a frozen critic's record naming critic.checkpoint "
                              "(an NLA needs its reconstructor)")


def _run_parts(run: Path, source: str) -> NlaParts:
    from nla_grpo.orchestrator.run_dir import RunDir

    cfg_path = run / "config.yaml"
    if not cfg_path.is_file():
        raise NlaInputError(run, "not an NLA: expected a pipeline run (pipeline.json), an RL run (config.yaml, checkpoints/) "
                                 f"or an exported NLA ({EXPORT_RECORD})")
    rd = RunDir(run)
    ckpt = rd.loadable_checkpoint(log=lambda *a: None)
    if ckpt is None:
        raise NlaInputError(run / "checkpoints", "no checkpoint yet (train the run first, or pass an adapter and a critic)")
    cfg = rd.config()
    from nla_grpo.orchestrator.checkpoint import policy_adapter
    from nla_grpo.shared.adapter import ADAPTER_CONFIG

    adapter = policy_adapter(ckpt)
    if not (adapter / ADAPTER_CONFIG).is_file():
        raise NlaInputError(ckpt, f"{(adapter / ADAPTER_CONFIG).relative_to(ckpt)}: missing (no verbaliser adapter in the checkpoint)")
    spec = _spec_for(cfg)
    critic = _checkpoint_critic(ckpt, cfg)
    # the co-trained critic of this checkpoint, not the one the run started from
    cfg = cfg.model_copy(update={"critic": cfg.critic.model_copy(update={"checkpoint": str(critic)}),
                                 "learner": cfg.learner.model_copy(update={"adapter_init": str(adapter)})})
    return NlaParts(cfg, spec, adapter, critic, Path(cfg.model.path), _fve_baseline(run, spec), f"{source} ({ckpt.name})")


def _export_parts(root: Path) -> NlaParts:
    from nla_grpo.shared.config import load_config
    from nla_grpo.shared.spec import load_spec

    from nla_grpo.shared.fileio import read_json_object

    record = read_json_object(root / EXPORT_RECORD)
    if record.get("format") != "nla-grpo-export" or not isinstance(record.get("fve_baseline"), (int, float)):
        raise NlaInputError(root / EXPORT_RECORD, f"format: expected nla-grpo-export with an fve_baseline, found {record.get('format')!r}")
    cfg = load_config(root / "config.yaml")
    spec = load_spec(root / "verbalizer" / "nla_meta.yaml")
    subject = Path(record.get("subject_model") or "")
    if not subject.is_dir():
        raise NlaInputError(root / EXPORT_RECORD, f"subject_model: {str(subject)!r} is not a directory (the activations are "
                                                  "read from it; pass subject= to point at it)")
    critic = root / "critic"
    return NlaParts(cfg, spec, None, critic, subject, float(record["fve_baseline"]), f"{root} (exported)")


def _official_critic(ar_dir: Path, subject: Path) -> Path:
    """An AR-LoRA directory (the reference trainer's and official release's layout) as a critic checkpoint, converted
    once into a temporary directory removed at exit."""
    import atexit
    import shutil
    import tempfile

    from nla_grpo.critic.import_reference import import_reference_ar

    tmp = Path(tempfile.mkdtemp(prefix="nla-ar-"))
    atexit.register(shutil.rmtree, tmp, True)
    import_reference_ar(ar_dir, tmp / "critic", subject)
    return tmp / "critic"


def _critic_dir(path: Path, subject: Path) -> Path:
    """A critic checkpoint (``critic_meta.json``) as it is, an AR-LoRA directory (``ar_meta.json``) converted."""
    if (path / "ar_meta.json").is_file() and not (path / "critic_meta.json").is_file():
        return _official_critic(path, subject)
    return path


def _pair_parts(root: Path) -> NlaParts:
    """A merged verbaliser with its ``nla_meta.yaml`` (``root/verbalizer``) beside its reconstructor (``root/critic``
    or the AR-LoRA ``root/ar``), without this project's record: settings from the sidecar, the rest defaults."""
    import yaml

    from nla_grpo.shared.config import build_config
    from nla_grpo.shared.spec import load_spec

    verbalizer = root / "verbalizer"
    spec = load_spec(verbalizer / "nla_meta.yaml")
    meta = yaml.safe_load((verbalizer / "nla_meta.yaml").read_text(encoding="utf-8")) or {}
    subject = spec.resolve_base_model()
    if subject is None:
        raise NlaInputError(verbalizer / "nla_meta.yaml", f"extraction.base_model: {spec.base_model!r} is not a directory "
                                                          "(the subject model the activations are read from)")
    injection = {k: v for k, v in (meta.get("injection") or {}).items() if k in ("mode", "scale", "karvonen_layer")}
    critic = next((root / name for name in ("critic", "ar") if (root / name).is_dir()), None)
    if critic is None:
        raise NlaInputError(root, "no reconstructor: expected critic/ (critic_meta.json) or ar/ (ar_meta.json) beside verbalizer/")
    critic = _critic_dir(critic, subject)
    gen = meta.get("generation") or {}
    rollout = {k: gen[k] for k in ("prefill", "extra_stop_tokens", "max_new_tokens", "cap_is_failure") if k in gen}
    prompts = {"enable_thinking": gen["enable_thinking"]} if "enable_thinking" in gen else {}
    cfg = build_config({"model": {"path": str(verbalizer)}, "data": {"parquet": str(spec.path), "sidecar": str(spec.path)},
                        "injection": injection, "rollout": rollout, "prompts": prompts, "placement": {"mode": "cpu"},
                        "critic": {"checkpoint": str(critic)}}, str(verbalizer / "nla_meta.yaml"))
    return NlaParts(cfg, spec, None, critic, subject, sidecar_baseline(spec), f"{root} (verbaliser and reconstructor)")


def locate(path) -> NlaParts:
    """The parts of the NLA at ``path`` (a pipeline run, an RL run or an exported NLA)."""
    root = Path(path)
    if not root.exists():
        raise NlaInputError(root, "not found")
    if not root.is_dir():
        raise NlaInputError(root, "expected a directory (a pipeline run, an RL run or an exported NLA)")
    if (root / EXPORT_RECORD).is_file():
        parts = _export_parts(root)
    elif (root / "verbalizer" / "nla_meta.yaml").is_file():
        parts = _pair_parts(root)
    elif (root / "pipeline.json").is_file():
        if not (root / "rl").is_dir():
            raise NlaInputError(root / "rl", "missing: the pipeline has not reached RL (run it to the end, or pass the "
                                             "sft_av/adapter and sft_ar/critic as parts)")
        parts = _run_parts(root / "rl", f"pipeline {root}")
    else:
        parts = _run_parts(root, f"run {root}")
    check_parts(parts)
    return parts


def from_parts(adapter, critic, sidecar, model=None, config=None) -> NlaParts:
    """An NLA from an AV adapter directory, a critic checkpoint and the data sidecar it was trained on. ``model``:
    the subject model (default: the critic's ``base_model``); ``config``: the run config whose prompts, sampling
    and stops to use (default: the project's defaults with the adapter's injection record)."""
    from nla_grpo.shared.config import build_config, load_config
    from nla_grpo.shared.spec import load_spec

    from nla_grpo.critic.checkpoint import read_meta

    adapter, critic = Path(adapter), Path(critic)
    spec = load_spec(sidecar)
    if model is None and (critic / "ar_meta.json").is_file() and spec.resolve_base_model() is not None:
        model = spec.resolve_base_model()
    if model is not None:
        critic = _critic_dir(critic, Path(model))
    meta = read_meta(critic)
    subject = Path(model) if model is not None else Path(meta.base_model)
    if not subject.is_dir():
        raise NlaInputError(critic / "critic_meta.json", f"base_model: {str(subject)!r} is not a directory (pass the subject model)")
    if config is not None:
        cfg = load_config(config)
    else:
        injection = {}
        record = adapter / "nla_injection.json"
        if record.is_file():
            raw = json.loads(record.read_text(encoding="utf-8"))
            injection = {k: raw[k] for k in ("mode", "scale") if raw.get(k) is not None}
        cfg = build_config({"model": {"path": str(subject)}, "data": {"parquet": str(spec.path), "sidecar": str(spec.path)},
                            "injection": injection, "placement": {"mode": "cpu"}}, str(adapter))
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(subject)}),
                                 "critic": cfg.critic.model_copy(update={"checkpoint": str(critic)})})
    parts = NlaParts(cfg, spec, adapter, critic, subject, sidecar_baseline(spec), f"adapter {adapter}, critic {critic}")
    check_parts(parts)
    return parts


def check_parts(parts: NlaParts) -> None:
    """The verbaliser, the reconstructor and the sidecar must describe one subject model, layer and width."""
    from nla_grpo.critic.checkpoint import read_meta
    from nla_grpo.shared.adapter import AdapterDir
    from nla_grpo.shared.model_checks import model_config_field

    spec = parts.spec
    if not parts.critic.is_dir():
        raise NlaInputError(parts.critic, "critic checkpoint not found (an NLA needs its reconstructor)")
    meta = read_meta(parts.critic)
    if meta.d_model != spec.d_model:
        raise NlaInputError(parts.critic / "critic_meta.json", f"d_model: the verbaliser's data are {spec.d_model} wide, "
                                                               f"this critic's {meta.d_model} (another subject model)")
    width = model_config_field(parts.subject, "hidden_size")
    if width is not None and int(width) != spec.d_model:
        raise NlaInputError(parts.subject, f"hidden_size: expected {spec.d_model} (the NLA's width), found {width}")
    if parts.adapter is not None:
        AdapterDir.read(parts.adapter, "verbaliser adapter")
        sft = parts.adapter / "nla_sft.json"
        if sft.is_file():
            raw = json.loads(sft.read_text(encoding="utf-8"))
            for key, want in (("layer_index", spec.layer_index), ("d_model", spec.d_model)):
                if key in raw and raw[key] != want:
                    raise NlaInputError(sft, f"{key}: the adapter was trained on {raw[key]}, the critic's data on {want} "
                                             "(parts of different NLAs)")
    if meta.base_model and Path(meta.base_model).is_dir() and Path(meta.base_model).resolve() != parts.subject.resolve():
        same = _same_model(Path(meta.base_model), parts.subject)
        if not same:
            raise NlaInputError(parts.critic / "critic_meta.json", f"base_model: {meta.base_model}, but the NLA's subject "
                                                                   f"model is {parts.subject} (parts of different NLAs)")


def _same_model(a: Path, b: Path) -> bool:
    """Two model directories hold the same weights (a copy of an exported NLA's subject model counts)."""
    import hashlib

    def digest(d: Path) -> str | None:
        files = sorted(d.glob("*.safetensors"))
        if not files:
            return None
        h = hashlib.sha256()
        for f in files:
            h.update(f.read_bytes() if f.stat().st_size < 64 << 20 else f.name.encode() + str(f.stat().st_size).encode())
        return h.hexdigest()

    first = digest(a)
    return first is not None and first == digest(b)

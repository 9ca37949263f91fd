"""A learner checkpoint directory: the one place that knows its layout (``critic/checkpoint.py`` is the critic's).

    policy/                   the trained adapter (adapter_model.safetensors, adapter_config.json, nla_injection.json)
    reference/                the frozen KL reference adapter, or reference.json pointing at the run's one copy
    optimizer.safetensors     the optimiser's tensors, optimizer.json its hyper-parameters and parameter names
    rng.safetensors           every RNG state the update draws from
    learner_state.json        format, step, adapter version, injection mode, the micro-batch token budget

``save`` / ``load`` below write and read it (``Learner.save`` / ``Learner.load`` call them);
``orchestrator.import_run`` writes one from a reference-trainer checkpoint through the same names and
``write_state``. The adapter directories' file names are ``shared.adapter``'s.
"""
from __future__ import annotations

from pathlib import Path

from nla_grpo.shared.adapter import ADAPTER_CONFIG
from nla_grpo.shared.adapter import ADAPTER_WEIGHTS as ADAPTER_FILE

CHECKPOINT_FORMAT = 1
STATE_FILE = "learner_state.json"
OPTIMIZER_TENSORS, OPTIMIZER_META = "optimizer.safetensors", "optimizer.json"
RNG_FILE = "rng.safetensors"
POLICY_ADAPTER_DIR, REFERENCE_DIR = "policy", "reference"  # the two adapters inside a learner checkpoint
REFERENCE_RECORD = "reference.json"  # where a checkpoint points at the run's frozen reference adapter


def write_state(directory, step: int, version: int, injection_mode: str, micro_batch_tokens: int | None) -> None:
    """``learner_state.json``: what the tensors do not say."""
    from nla_grpo.shared.fileio import write_json

    write_json(Path(directory) / STATE_FILE, {"format": CHECKPOINT_FORMAT, "step": step, "version": version,
                                              "injection_mode": injection_mode, "micro_batch_tokens": micro_batch_tokens})


def read_state(directory, injection_mode: str) -> dict:
    """``learner_state.json`` of a checkpoint this run can load: this format, this injection mode."""
    from nla_grpo.shared.fileio import read_json_object

    d = Path(directory)
    if not (d / STATE_FILE).is_file():
        raise FileNotFoundError(f"{d}: not a learner checkpoint (no {STATE_FILE})")
    state = read_json_object(d / STATE_FILE)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{d / STATE_FILE}: expected format {CHECKPOINT_FORMAT}, found {state.get('format')!r}")
    if state.get("injection_mode") != injection_mode:
        raise ValueError(f"{d / STATE_FILE}: saved with injection mode {state.get('injection_mode')!r}, "
                         f"this run uses {injection_mode!r}")
    return state


# ---- a Learner's whole state, written and read (Learner.save / save_reference / load call these) ----
def save(learner, directory, reference: str | None = None) -> Path:
    """Policy adapter, optimiser state, RNG, step and version, atomically; the frozen reference adapter
    too, or, given ``reference`` (a directory ``save_reference`` wrote), a record pointing at it."""
    from nla_grpo.learner.policy import POLICY, REFERENCE
    from nla_grpo.shared.fileio import atomic_directory, capture_rng, save_optimizer, save_tensors, write_reference

    with atomic_directory(directory) as tmp:
        save_adapter(learner, POLICY, tmp / POLICY_ADAPTER_DIR)
        if reference is None:
            save_adapter(learner, REFERENCE, tmp / REFERENCE_DIR)
        else:
            # relative to the final directory, which sits where ``tmp`` does
            write_reference(tmp / REFERENCE_RECORD, reference, [ADAPTER_FILE, ADAPTER_CONFIG])
        save_optimizer(tmp, learner.optimizer, learner.param_names, OPTIMIZER_TENSORS, OPTIMIZER_META)
        save_tensors(tmp / RNG_FILE, capture_rng())
        write_state(tmp, learner.step, learner.version, learner.cfg.injection.mode, learner.micro_batch_tokens)
    return Path(directory)


def save_reference(learner, directory) -> Path:
    """The frozen reference adapter alone (written once per run; checkpoints then point at it)."""
    from nla_grpo.learner.policy import REFERENCE
    from nla_grpo.shared.fileio import atomic_directory

    with atomic_directory(directory) as tmp:
        save_adapter(learner, REFERENCE, tmp, mkdir=False)
    return Path(directory)


def save_adapter(learner, name: str, directory: Path, mkdir: bool = True) -> None:
    """One of the learner's adapters as a PEFT directory (tensors, config, the injection record it reads)."""
    from nla_grpo.shared.fileio import save_tensors, write_json
    from nla_grpo.shared.injection import INJECTION_RECORD, injection_record

    if mkdir:
        directory.mkdir()
    save_tensors(directory / ADAPTER_FILE, learner.policy.adapter_parameters(name))
    write_json(directory / ADAPTER_CONFIG, peft_config(learner, name))
    write_json(directory / INJECTION_RECORD, injection_record(learner.cfg))  # what the adapter expects to read


def _load_adapter(learner, name: str, path: Path) -> None:
    import torch

    from nla_grpo.shared.fileio import load_tensors

    tensors = load_tensors(path)
    live = learner.policy.adapter_parameters(name)
    if set(tensors) != set(live):
        missing, extra = sorted(set(live) - set(tensors)), sorted(set(tensors) - set(live))
        raise ValueError(f"{path}: adapter keys do not match the model (missing {missing[:3]}, unexpected {extra[:3]})")
    with torch.no_grad():
        for key, p in live.items():
            if tensors[key].shape != p.shape:
                raise ValueError(f"{path}: {key}: expected shape {tuple(p.shape)}, found {tuple(tensors[key].shape)}")
            p.copy_(tensors[key])


def load(learner, directory) -> None:
    """Restore a ``save``d state exactly (policy, reference, optimiser, RNG, step, version)."""
    from nla_grpo.learner.policy import POLICY, REFERENCE
    from nla_grpo.shared.fileio import load_optimizer, load_tensors, resolve_reference, restore_rng

    d = Path(directory)
    state = read_state(d, learner.cfg.injection.mode)
    # first: it checks that the saved parameters are this adapter's before anything is overwritten
    load_optimizer(d, learner.optimizer, learner.param_names, OPTIMIZER_TENSORS, OPTIMIZER_META, what="policy adapter")
    _load_adapter(learner, POLICY, d / POLICY_ADAPTER_DIR / ADAPTER_FILE)
    # the reference is the run's initial adapter: restored from the checkpoint (a copy, or the frozen
    # file its record points at, checked against its SHA-256), never trained
    if (d / REFERENCE_DIR).is_dir():
        _load_adapter(learner, REFERENCE, d / REFERENCE_DIR / ADAPTER_FILE)
    else:
        _load_adapter(learner, REFERENCE, resolve_reference(d / REFERENCE_RECORD) / ADAPTER_FILE)
    restore_rng(load_tensors(d / RNG_FILE))
    learner.step, learner.version = int(state["step"]), int(state["version"])
    # the same micro-batches as the run that saved it (older checkpoints: chosen afresh)
    learner.micro_batch_tokens = state.get("micro_batch_tokens")


# ---- what leaves the learner between checkpoints: the pushed adapter, the state's fingerprint ----
def peft_config(learner, name: str) -> dict:
    from nla_grpo.shared.fileio import jsonable

    return jsonable(learner.model.peft_config[name].to_dict())


def export_adapter(learner, device: str = "cpu"):
    """The policy adapter with PEFT's saved key names, its PEFT config and version.

    Tensors are snapshots (they share no storage with the trained weights): on the CPU by default;
    ``device="same"`` keeps them on the learner's device for an engine in this process;
    ``device="live"`` hands out the trained weights themselves (detached), for a caller that copies
    them at once (``shared.weight_sync`` packs them into its buffer).
    """
    from peft import get_peft_model_state_dict

    from nla_grpo.learner.policy import POLICY
    from nla_grpo.shared.fileio import cpu_copy
    from nla_grpo.shared.types import AdapterUpdate

    state = get_peft_model_state_dict(learner.model, adapter_name=POLICY)
    copy = {"cpu": cpu_copy, "same": lambda t: t.detach().clone().contiguous(), "live": lambda t: t.detach()}[device]
    return AdapterUpdate(version=learner.version, tensors={k: copy(v) for k, v in state.items()},
                         peft_config=peft_config(learner, POLICY))


def checksum(learner) -> list[float]:
    """A cheap fingerprint of the trained state (float64 sums over the policy adapter and the first
    optimiser moments): data-parallel ranks that took the same steps hold the same bits."""
    import torch

    with torch.no_grad():
        total = torch.zeros(3, dtype=torch.float64, device=learner.device)
        for p in learner.params:
            x = p.detach().double()
            total[0] += x.sum()
            total[1] += (x * x).sum()
            moment = learner.optimizer.state.get(p, {}).get("exp_avg")
            if moment is not None:
                total[2] += moment.double().abs().sum()
    return [learner.step, learner.version, *total.tolist()]

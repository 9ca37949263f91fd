"""A learner checkpoint directory: the one place that knows its layout (``critic/checkpoint.py`` is the critic's).

    policy/                   the trained adapter (adapter_model.safetensors, adapter_config.json, nla_injection.json)
    reference/                the frozen KL reference adapter, or reference.json pointing at the run's one copy
    optimizer.safetensors     the optimiser's tensors, optimizer.json its hyper-parameters and parameter names
    rng.safetensors           every RNG state the update draws from
    learner_state.json        format, step, adapter version, injection mode, the micro-batch token budget

``Learner.save`` / ``Learner.load`` write and read it; ``orchestrator.import_run`` writes one from a
reference-trainer checkpoint through the same names and ``write_state``.
"""
from __future__ import annotations

from pathlib import Path

CHECKPOINT_FORMAT = 1
STATE_FILE = "learner_state.json"
OPTIMIZER_TENSORS, OPTIMIZER_META = "optimizer.safetensors", "optimizer.json"
RNG_FILE = "rng.safetensors"
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
POLICY_DIR, REFERENCE_DIR = "policy", "reference"
REFERENCE_RECORD = "reference.json"  # where a checkpoint points at the run's frozen reference adapter


def write_state(directory, step: int, version: int, injection_mode: str, micro_batch_tokens: int | None) -> None:
    """``learner_state.json``: what the tensors do not say."""
    from shared.fileio import write_json

    write_json(Path(directory) / STATE_FILE, {"format": CHECKPOINT_FORMAT, "step": step, "version": version,
                                              "injection_mode": injection_mode, "micro_batch_tokens": micro_batch_tokens})


def read_state(directory, injection_mode: str) -> dict:
    """``learner_state.json`` of a checkpoint this run can load: this format, this injection mode."""
    from shared.fileio import read_json_object

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

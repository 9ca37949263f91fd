"""``nla-grpo import-run``: a reference-trainer checkpoint as a run directory that ``train --resume`` continues.

The reference trainer saves ``iter_NNNNNN/`` every ``--save-every`` steps: the policy adapter at the top
level, the frozen KL reference under ``reference/``, the co-trained AR under ``critic/`` (when it trained
one) and ``training_state.pt`` (step, row order and cursor, numpy and torch RNG states, the optimisers'
``state_dict``). This turns one into ``NEW_RUN/checkpoints/step_NNNNNN/`` in this project's format:

- policy = the iter adapter, reference = the AV-SFT adapter (``--av-sft``, the KL anchor the reference
  trainer always takes from there), both copied into ``NEW_RUN/imported/``;
- the actor's AdamW moments and step counts, parameter by parameter in the PEFT order both projects
  build (checked against every adapter tensor's size); the learning rate is the config's;
- the row order, cursor and numpy generator state (``data.order: reference``; the training rows must
  be the reference's, the first ``data.max_rows`` rows: ``data.eval_skip_rows`` gives its split);
- the torch RNG states as the learner's;
- the critic: ``critic/`` through the AR importer when the reference co-trained one, otherwise the
  config's ``critic.checkpoint``.

``training_state.pt`` is read with ``torch.load(weights_only=True)`` only: a file that needs arbitrary
unpickling is refused. What cannot be carried over exactly is printed, one line each.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from nla_grpo.shared.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from nla_grpo.shared.errors import NlaInputError

TRAINING_STATE = "training_state.pt"
ADAPTER_FILES = (ADAPTER_WEIGHTS, ADAPTER_CONFIG)
NESTED_8BIT = "__bnb_optimizer_quant_state__"  # where bitsandbytes' 8-bit optimisers keep their moments


def read_training_state(path: Path) -> dict:
    """``training_state.pt`` through ``torch.load(weights_only=True)``, its fields checked."""
    import pickle

    import torch

    if not path.is_file():
        raise NlaInputError(path.parent, f"no {TRAINING_STATE} (not a reference-trainer checkpoint directory, or saved "
                                         "before it kept its training state)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        raise NlaInputError(path, f"needs arbitrary unpickling, which is refused (only tensors and plain types load): {first}") from None
    except Exception as exc:  # a cut or damaged file: its own one-line reason
        raise NlaInputError(path, f"not readable ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]})") from None
    if not isinstance(state, dict):
        raise NlaInputError(path, f"expected a dict, found {type(state).__name__}")
    if state.get("version") != 1:
        raise NlaInputError(path, f"version: expected 1, found {state.get('version')!r}")
    expect = {"step": int, "cursor": int, "pending_idxs": list, "numpy_rng_state": dict, "actor_optim_state": dict}
    for key, kind in expect.items():
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            raise NlaInputError(path, f"{key}: expected {kind.__name__}, found {type(state.get(key)).__name__}")
    if not isinstance(state.get("torch_rng_state"), torch.Tensor):
        raise NlaInputError(path, f"torch_rng_state: expected a tensor, found {type(state.get('torch_rng_state')).__name__}")
    return state


def _adapter_dir(path: Path, what: str) -> Path:
    for name in ADAPTER_FILES:
        if not (path / name).is_file():
            raise NlaInputError(path, f"{what}: expected a PEFT adapter directory, {name} is missing")
    return path


def _copy_adapter(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for name in ADAPTER_FILES + ("nla_injection.json",):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def adapter_order(adapter: Path, model_dir: Path) -> list[str]:
    """The adapter's tensor names in the order PEFT's ``parameters()`` gives them (module order, lora_A
    before lora_B): the order of the reference trainer's optimiser and of this project's learner."""
    import re

    from safetensors import safe_open

    from nla_grpo.shared.model_checks import _linear_modules

    position = {name: i for i, name in enumerate(_linear_modules(str(model_dir)))}
    with safe_open(str(adapter / ADAPTER_WEIGHTS), framework="pt") as f:
        keys = list(f.keys())

    def where(key):
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])\.weight", key)
        if m is None or m.group(1) not in position:
            raise NlaInputError(adapter / ADAPTER_WEIGHTS, f"{key}: not a LoRA tensor of a linear module of {model_dir}")
        return position[m.group(1)], m.group(2)

    return sorted(keys, key=where)


def saved_by_8bit(state: dict) -> bool:
    """An optimiser ``state_dict`` of bitsandbytes' 8-bit AdamW (its quantised moments), not torch's."""
    return any(NESTED_8BIT in s or "state1" in s for s in state.get("state", {}).values())


def _actor_optimizer(state: dict, names: list[str], sizes: dict[str, int], lr: float, path: Path) -> tuple[dict, str, list[str]]:
    """The reference actor optimiser's ``state_dict`` re-keyed for this learner; its class name; notes."""
    notes = []
    groups = state.get("param_groups") or []
    ids = [i for g in groups for i in g.get("params", [])]
    if len(ids) != len(names):
        raise NlaInputError(path, f"actor_optim_state: {len(ids)} parameters, the policy adapter has {len(names)} LoRA tensors")
    eightbit = saved_by_8bit(state)
    for pid, name in zip(ids, names):
        entry = state.get("state", {}).get(pid, {})
        moment = entry.get("exp_avg", entry.get(NESTED_8BIT, entry).get("state1"))
        if moment is not None and moment.numel() != sizes[name]:
            raise NlaInputError(path, f"actor_optim_state: parameter {pid} has {moment.numel()} moment entries, {name} has "
                                      f"{sizes[name]} (the optimiser's parameters are not the adapter's in PEFT order)")
    saved_lr = groups[0].get("lr") if groups else None
    if saved_lr is not None and saved_lr != lr:
        notes.append(f"learning rate: the reference run had {saved_lr}, the config's {lr} continues")
    remap = {pid: i for i, pid in enumerate(ids)}
    new_groups = [{**g, "lr": lr, "params": [remap[p] for p in g.get("params", [])]} for g in groups]
    new_state = {remap[pid]: entry for pid, entry in state.get("state", {}).items() if pid in remap}
    return {"state": new_state, "param_groups": new_groups}, ("AdamW8bit" if eightbit else "AdamW"), notes


def _check_anchor(iter_dir: Path, av_sft: Path) -> None:
    """``ITER_DIR/reference/`` (where the reference trainer saved its KL anchor) holds the ``--av-sft`` tensors."""
    from nla_grpo.shared.fileio import load_tensors

    saved = iter_dir / "reference" / ADAPTER_WEIGHTS
    if not saved.is_file():
        return
    a, b = load_tensors(saved), load_tensors(av_sft / ADAPTER_WEIGHTS)
    same = a.keys() == b.keys() and all(a[k].shape == b[k].shape and bool((a[k] == b[k]).all()) for k in a)
    if not same:
        raise NlaInputError(av_sft, f"--av-sft: its tensors are not those of {saved.parent}, the KL anchor that run used")


def import_run(iter_dir, av_sft, config, run_dir, overrides=(), log=print) -> Path:
    """Write ``run_dir`` (removed again if anything fails); returns its checkpoint directory."""
    from nla_grpo.orchestrator.run_dir import RunDir

    iter_dir, av_sft, run_dir = Path(iter_dir), Path(av_sft), Path(run_dir)
    RunDir.check_new(run_dir)
    if not iter_dir.is_dir():
        raise NlaInputError(iter_dir, "not a directory (expected the reference trainer's iter_NNNNNN)")
    _adapter_dir(iter_dir, "ITER_DIR")
    _adapter_dir(av_sft, "--av-sft")
    state = read_training_state(iter_dir / TRAINING_STATE)
    _check_anchor(iter_dir, av_sft)
    existed = run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt, notes = _write_run(iter_dir, av_sft, config, run_dir.resolve(), list(overrides), state, log)
    except BaseException:
        if existed:  # it was empty (check_new): empty it again
            for child in run_dir.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    for line in notes:
        log(f"[import] not carried over exactly: {line}")
    log(f"[import] {run_dir}: step {state['step']}, cursor {state['cursor']} of {len(state['pending_idxs'])} rows; "
        f"continue with `nla-grpo train --resume {run_dir} --steps N`")
    return ckpt


def _write_run(iter_dir: Path, av_sft: Path, config, run: Path, overrides: list[str], state: dict, log):
    import torch
    from safetensors import safe_open

    from nla_grpo.critic.checkpoint import FROZEN_RECORD, META_NAME, WEIGHTS_NAME, write_frozen_record
    from nla_grpo.critic.import_reference import import_reference_ar
    from nla_grpo.learner.checkpoint import OPTIMIZER_META, OPTIMIZER_TENSORS, POLICY_ADAPTER_DIR, REFERENCE_RECORD, RNG_FILE, write_state
    from nla_grpo.orchestrator.checkpoint import CRITIC_DIR, RunState
    from nla_grpo.orchestrator.checkpoint import LEARNER_DIR
    from nla_grpo.orchestrator.job import absolute_paths, prepare_job
    from nla_grpo.shared.config import build_config, dump_config, load_config
    from nla_grpo.shared.data import ReferenceOrder
    from nla_grpo.shared.fileio import save_tensors, split_optimizer_state, write_json, write_reference, write_text

    step, notes = state["step"], []
    cfg = absolute_paths(load_config(config, overrides), Path.cwd())
    imported = run / "imported"
    _copy_adapter(iter_dir, imported / "policy")
    _copy_adapter(av_sft, imported / "av_sft")
    raw = cfg.model_dump(mode="python")
    raw["learner"].update(adapter_init=str(imported / "policy"), reference_adapter=str(imported / "av_sft"))
    raw["data"]["order"] = "reference"
    if (iter_dir / "critic").is_dir():
        import_reference_ar(iter_dir / "critic", imported / "critic", cfg.model.path)
        raw["critic"]["checkpoint"] = str(imported / "critic")
        if not cfg.critic.train:
            notes.append(f"critic: the reference run co-trained it; with critic.train false it stays as it was at step {step}")
    elif cfg.critic.train:
        if cfg.critic.checkpoint is None:
            raise NlaInputError("config", "critic.checkpoint: the reference run co-trained no critic (no critic/ in "
                                          f"{iter_dir}); name the AR it scored with (`nla-grpo critic import-reference`)")
        notes.append("critic: the reference run did not train it; critic.train true trains it from here on")
    # the reference trainer encodes critic prompts without special tokens: its ARs read them so
    raw["critic"]["add_bos"] = False
    sd = state["actor_optim_state"]
    eightbit = saved_by_8bit(sd)
    kind = "adamw8bit" if eightbit else "adamw"
    if cfg.learner.optimizer not in ("auto", kind):
        raise NlaInputError(iter_dir / TRAINING_STATE, f"actor_optim_state: saved by {'8-bit' if eightbit else 'torch'} AdamW, "
                                                       f"the config has learner.optimizer {cfg.learner.optimizer} (set "
                                                       f"learner.optimizer: {kind})")
    raw["learner"]["optimizer"] = kind
    cfg = build_config(raw, str(config))
    job = prepare_job(cfg, log=log)  # the config's own checks: data, adapters, critic structure

    # ---- the data order: the reference's rows, list, cursor and generator ----
    pending = [int(i) for i in state["pending_idxs"]]
    if len(pending) != len(job.train) or job.train.row_ids.tolist() != list(range(len(pending))):
        raise NlaInputError(iter_dir / TRAINING_STATE, f"pending_idxs: the reference run ordered {len(pending)} rows (the first "
                                                       f"{len(pending)} of its parquet), the config trains on {len(job.train)} "
                                                       f"(set data.max_rows: {len(pending)} and data.eval_skip_rows as that run had)")
    try:
        order = ReferenceOrder(len(pending), cfg.seed, pending, state["cursor"], state["numpy_rng_state"])
    except (ValueError, TypeError, KeyError) as exc:
        raise NlaInputError(iter_dir / TRAINING_STATE, f"pending_idxs / numpy_rng_state: {exc}") from None

    # ---- the policy: adapter, frozen reference, optimiser, RNG, step ----
    names = adapter_order(imported / "policy", Path(cfg.model.path))
    with safe_open(str(imported / "policy" / ADAPTER_WEIGHTS), framework="pt") as f:
        sizes = {k: int(torch.Size(f.get_slice(k).get_shape()).numel()) for k in names}
    optim, optim_class, more = _actor_optimizer(sd, names, sizes, cfg.learner.lr, iter_dir / TRAINING_STATE)
    notes += more
    ckpt = run / "checkpoints" / f"step_{step:06d}"
    policy = ckpt / LEARNER_DIR
    (policy / POLICY_ADAPTER_DIR).mkdir(parents=True)
    for name in ADAPTER_FILES:
        shutil.copy2(imported / "policy" / name, policy / POLICY_ADAPTER_DIR / name)
    frozen = run / "frozen" / "reference"
    _copy_adapter(imported / "av_sft", frozen)
    write_reference(policy / REFERENCE_RECORD, frozen, list(ADAPTER_FILES))
    tensors, meta = split_optimizer_state(optim)
    save_tensors(policy / OPTIMIZER_TENSORS, tensors)
    write_json(policy / OPTIMIZER_META, {**meta, "param_names": names, "optimizer": optim_class}, indent=1)
    rng = {"torch_cpu": state["torch_rng_state"]}
    for i, s in enumerate(state.get("cuda_rng_state_all") or []):
        rng[f"cuda.{i}"] = s
    save_tensors(policy / RNG_FILE, rng)
    write_state(policy, step, step + 1, cfg.injection.mode, None)

    # ---- the critic ----
    if cfg.critic.train:
        (ckpt / CRITIC_DIR).mkdir()
        for name in (WEIGHTS_NAME, META_NAME):
            shutil.copy2(Path(cfg.critic.checkpoint) / name, ckpt / CRITIC_DIR / name)
        if state.get("critic_optim_state"):
            notes.append("critic optimiser: its AdamW moments restart at zero (this critic's value head has a bias the "
                         "reference's lacks, so the parameter lists differ)")
    else:
        write_frozen_record(ckpt / FROZEN_RECORD, cfg.critic.checkpoint)
    notes.append("rollout sampling: vLLM's seeded sampler replaces the reference's torch RNG stream, so the responses "
                 "differ from those the reference run would have sampled")

    # ---- the run directory ----
    RunState(step, order.state(), step + 1, job.cfg.model_dump(mode="json"), job.data_fingerprint,
             imported_from=str(iter_dir.resolve())).write(ckpt)
    (run / "checkpoints").mkdir(exist_ok=True)
    write_text(run / "config.yaml", dump_config(cfg))
    return ckpt, notes

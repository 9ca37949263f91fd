"""Checkpoint I/O that never unpickles: tensors in safetensors, everything else in JSON, and a
directory that appears all at once (written beside its final place, then renamed).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from enum import Enum
from pathlib import Path

import torch

_PRIMITIVES = (bool, int, float, str, type(None))


def jsonable(obj):
    """A JSON-safe copy: sets become sorted lists, tuples lists, enums their values."""
    if isinstance(obj, Enum):
        return jsonable(obj.value)
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return sorted(jsonable(v) for v in obj)
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, _PRIMITIVES):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in JSON: {obj!r}")


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached, contiguous CPU tensor that shares no storage with ``t`` (safetensors refuses shared storage)."""
    return t.detach().to("cpu", copy=True).contiguous()


def split_optimizer_state(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """``optimizer.state_dict()`` -> (tensors keyed ``state.<param>.<key>``, JSON-safe rest)."""
    tensors, scalars = {}, {}
    for pid, entry in state_dict["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{pid}.{key}"] = cpu_copy(value)
            elif isinstance(value, _PRIMITIVES):
                scalars.setdefault(str(pid), {})[key] = value
            else:
                raise TypeError(f"optimizer state {pid}.{key}: cannot store a {type(value).__name__}")
    groups = []
    for group in state_dict["param_groups"]:
        for key, value in group.items():
            if isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer param group {key}: tensor hyper-parameters are not supported")
        groups.append({k: jsonable(v) for k, v in group.items()})
    tuples = sorted({k for g in state_dict["param_groups"] for k, v in g.items() if isinstance(v, tuple)})
    return tensors, {"param_groups": groups, "scalars": scalars, "tuple_keys": tuples}


def join_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """Inverse of ``split_optimizer_state``."""
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        _, pid, key = name.split(".", 2)
        state.setdefault(int(pid), {})[key] = value
    for pid, entry in meta["scalars"].items():
        state.setdefault(int(pid), {}).update(entry)
    tuple_keys = set(meta.get("tuple_keys", []))
    groups = [{k: tuple(v) if k in tuple_keys else v for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def capture_rng() -> dict[str, torch.Tensor]:
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"cuda.{i}"] = s
    return rng


def restore_rng(rng: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(rng["torch_cpu"])
    cuda = sorted((int(k.split(".")[1]), v) for k, v in rng.items() if k.startswith("cuda."))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([v for _, v in cuda][: torch.cuda.device_count()])


def write_json(path: Path, obj) -> None:
    Path(path).write_text(json.dumps(jsonable(obj), indent=2, sort_keys=True), encoding="utf-8")


def read_json(path: Path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


@contextlib.contextmanager
def atomic_directory(target: str | Path):
    """Yield a temporary directory beside ``target``; on success it replaces ``target`` in one rename.

    A crash leaves either the old checkpoint or the new one, never a half-written directory under
    the final name (only a ``.<name>.tmp-*`` sibling to clean up).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}-{tmp.name[-8:]}"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

"""File I/O every service shares: atomic writes, JSON-safe metadata, safetensors with one-line errors,
optimiser state and RNG as tensors + JSON. Nothing here ever unpickles.

- ``atomic_write(path, write)`` / ``write_json`` / ``write_text``: written beside the target, then
  renamed over it, so a reader sees the old file or the new one, never half of one;
- ``atomic_directory(target)``: the same for a whole directory;
- ``jsonable(obj, nonfinite=...)``: the one JSON sanitiser (sets, tuples, enums; NaN/inf kept,
  or replaced, e.g. by None for strict JSON lines);
- ``save_optimizer`` / ``load_optimizer``: ``optimizer.state_dict()`` as safetensors + JSON, one
  schema for learner and critic (the critic's older ``state_scalars`` files still load);
- ``write_reference`` / ``resolve_reference``: a small JSON record that points at a directory of
  frozen files (the reference adapter, a frozen critic) with each file's SHA-256, so a checkpoint
  need not copy what never changes.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
from enum import Enum
from pathlib import Path

from nla_grpo.shared.errors import NlaInputError

_PRIMITIVES = (bool, int, float, str, type(None))
_KEEP = object()


def jsonable(obj, nonfinite=_KEEP):
    """A JSON-safe copy: sets become sorted lists, tuples lists, enums their values; non-finite floats
    become ``nonfinite`` when it is given. Anything else is a ``TypeError`` naming it."""
    if isinstance(obj, Enum):
        return jsonable(obj.value, nonfinite)
    if isinstance(obj, dict):
        return {str(k): jsonable(v, nonfinite) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return sorted(jsonable(v, nonfinite) for v in obj)
    if isinstance(obj, (list, tuple)):
        return [jsonable(v, nonfinite) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj) and nonfinite is not _KEEP:
        return nonfinite
    if isinstance(obj, _PRIMITIVES):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in JSON: {obj!r}")


def atomic_write(path: str | Path, write) -> None:
    """``write(tmp_path)`` beside ``path``, then one rename over it; the temporary goes on failure."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: str | Path, obj, indent: int = 2) -> None:
    write_text(path, json.dumps(jsonable(obj), indent=indent, sort_keys=True) + "\n")


def iter_jsonl(path: str | Path):
    """``(line number, object)`` of each non-blank line of a JSONL file; a line that is not a JSON object
    is one line naming the file and the line."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise NlaInputError(path, f"line {n}: not JSON ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise NlaInputError(path, f"line {n}: expected an object, found {type(rec).__name__}")
            yield n, rec


def read_json_object(path: str | Path, missing: str = "file not found") -> dict:
    """A JSON object from ``path``, or a one-line error naming the file."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NlaInputError(path, missing) from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise NlaInputError(path, "not valid JSON") from None
    if not isinstance(raw, dict):
        raise NlaInputError(path, "expected a JSON object")
    return raw


@contextlib.contextmanager
def atomic_directory(target: str | Path):
    """Yield a temporary directory beside ``target``; on success it replaces ``target`` in one rename.

    A crash leaves either the old directory or the new one, never a half-written one under the final
    name (only a ``.<name>.tmp-*`` sibling to clean up).
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


def lock_directory(work: str | Path, busy: str):
    """Hold an OS lock on ``work/.lock`` (the returned file; closing it or exiting releases it); a second
    holder is refused with ``busy`` as one line naming the directory's parent."""
    import fcntl

    from nla_grpo.shared.errors import NlaInputError

    work = Path(work)
    f = open(work / ".lock", "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise NlaInputError(work.parent, busy) from None
    return f


# ---- tensors ------------------------------------------------------------------------------------
def cpu_copy(t):
    """A detached, contiguous CPU tensor that shares no storage with ``t`` (safetensors refuses shared storage)."""
    return t.detach().to("cpu", copy=True).contiguous()


def save_tensors(path: str | Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    flat = {k: cpu_copy(v) for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(flat, str(tmp), metadata={"format": "pt"}))


def load_tensors(path: str | Path) -> dict:
    """A safetensors file on the CPU, or a one-line error naming it."""
    path = Path(path)
    if not path.is_file():
        raise NlaInputError(path, "file not found")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise NlaInputError(path, f"not a readable safetensors file ({exc})") from None


# ---- optimiser state ----------------------------------------------------------------------------
def split_optimizer_state(state_dict: dict) -> tuple[dict, dict]:
    """``optimizer.state_dict()`` -> (tensors keyed ``state.<param>.<key>``, JSON-safe rest).

    One level of nesting is kept (``state.<param>.<key>.<inner>``): bitsandbytes' 8-bit optimisers
    wrap their quantised moments and absmax tensors in a dict under one key of each parameter's state.
    """
    import torch

    tensors, scalars = {}, {}

    def put(pid, key, value, inner=None):
        name = key if inner is None else f"{key}.{inner}"
        if isinstance(value, torch.Tensor):
            tensors[f"state.{pid}.{name}"] = cpu_copy(value)
        elif isinstance(value, _PRIMITIVES):
            slot = scalars.setdefault(str(pid), {})
            if inner is None:
                slot[key] = value
            else:
                slot.setdefault(key, {})[inner] = value
        elif isinstance(value, dict) and inner is None:
            for k, v in value.items():
                if "." in str(k):
                    raise TypeError(f"optimizer state {pid}.{key}.{k}: a key with a dot cannot be stored")
                put(pid, key, v, k)
            if not value:
                scalars.setdefault(str(pid), {})[key] = {}
        else:
            raise TypeError(f"optimizer state {pid}.{name}: cannot store a {type(value).__name__}")

    for pid, entry in state_dict["state"].items():
        for key, value in entry.items():
            if "." in str(key):
                raise TypeError(f"optimizer state {pid}.{key}: a key with a dot cannot be stored")
            put(pid, key, value)
    groups = []
    for group in state_dict["param_groups"]:
        for key, value in group.items():
            if isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer param group {key}: tensor hyper-parameters are not supported")
        groups.append({k: jsonable(v) for k, v in group.items()})
    tuples = sorted({k for g in state_dict["param_groups"] for k, v in g.items() if isinstance(v, tuple)})
    return tensors, {"param_groups": groups, "scalars": scalars, "tuple_keys": tuples}


def join_optimizer_state(tensors: dict, meta: dict) -> dict:
    """Inverse of ``split_optimizer_state``; also reads the critic's older meta (``state_scalars``, betas as a list)."""
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        _, pid, key = name.split(".", 2)
        entry = state.setdefault(int(pid), {})
        if "." in key:
            outer, inner = key.split(".", 1)
            entry.setdefault(outer, {})[inner] = value
        else:
            entry[key] = value
    for pid, scalars in meta.get("scalars", meta.get("state_scalars", {})).items():
        entry = state.setdefault(int(pid), {})
        for key, value in scalars.items():
            if isinstance(value, dict):
                entry.setdefault(key, {}).update(value)
            else:
                entry[key] = value
    tuple_keys = set(meta["tuple_keys"] if "tuple_keys" in meta else ["betas"])
    groups = [{k: tuple(v) if k in tuple_keys and isinstance(v, list) else v for k, v in g.items()}
              for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def save_optimizer(directory: str | Path, optimizer, param_names: list[str], tensors_name: str, meta_name: str) -> None:
    """``optimizer``'s state as ``tensors_name`` (safetensors) + ``meta_name`` (JSON) in ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors, meta = split_optimizer_state(optimizer.state_dict())
    save_tensors(d / tensors_name, tensors)
    write_json(d / meta_name, {**meta, "param_names": list(param_names), "optimizer": type(optimizer).__name__}, indent=1)


def load_optimizer(directory: str | Path, optimizer, param_names: list[str], tensors_name: str, meta_name: str,
                   what: str = "model") -> None:
    """Restore a state ``save_optimizer`` wrote; the optimiser kind and the parameter list must match."""
    d = Path(directory)
    meta_path = d / meta_name
    meta = read_json_object(meta_path)
    if meta.get("optimizer") != type(optimizer).__name__:
        raise NlaInputError(meta_path, f"optimizer: expected {type(optimizer).__name__}, found {meta.get('optimizer')!r}")
    saved = meta.get("param_names")
    if saved != list(param_names):
        diff = next((a for a, b in zip(saved or [], param_names) if a != b), None)
        raise NlaInputError(meta_path, f"param_names: do not match the {what}'s trainable tensors (first difference "
                                       f"{diff!r}, {len(saved or [])} saved vs {len(param_names)} now)")
    # the learning rate is the config's (the one the optimiser was built with): a resume may change it on
    # purpose (`--resume --set learner.lr=...`), and no schedule moves it, so the saved value is not restored
    rates = [g["lr"] for g in optimizer.param_groups]
    optimizer.load_state_dict(join_optimizer_state(load_tensors(d / tensors_name), meta))
    for group, lr in zip(optimizer.param_groups, rates):
        group["lr"] = lr


# ---- RNG ----------------------------------------------------------------------------------------
def capture_rng() -> dict:
    import torch

    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"cuda.{i}"] = s
    return rng


def restore_rng(rng: dict) -> None:
    import torch

    torch.set_rng_state(rng["torch_cpu"])
    cuda = sorted((int(k.split(".")[1]), v) for k, v in rng.items() if k.startswith("cuda."))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([v for _, v in cuda][: torch.cuda.device_count()])


# ---- references to frozen files ---------------------------------------------------------------
REFERENCE_FORMAT = "nla-grpo-reference"
_DIGESTS: dict[tuple, str] = {}  # (path, size, mtime_ns) -> sha256: a frozen file is hashed once per process


def sha256_file(path: str | Path) -> str:
    path = Path(path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def write_reference(record: str | Path, target: str | Path, names: list[str], relative: bool = True) -> None:
    """``record`` (JSON) points at ``target`` (relative to the record's directory when ``relative``, so
    the run directory can move) and holds the SHA-256 of each of ``names`` in it."""
    record, target = Path(record), Path(target)
    where = os.path.relpath(target.resolve(), record.parent.resolve()) if relative else str(target.resolve())
    write_json(record, {"format": REFERENCE_FORMAT, "path": where,
                        "sha256": {n: sha256_file(target / n) for n in names}})


def resolve_reference(record: str | Path, verify: bool = True) -> Path:
    """The directory ``record`` points at; with ``verify``, every file it lists must be there with its
    SHA-256. A one-line error names the record and the file otherwise."""
    record = Path(record)
    raw = read_json_object(record)
    if raw.get("format") != REFERENCE_FORMAT or not isinstance(raw.get("path"), str) or not isinstance(raw.get("sha256"), dict):
        raise NlaInputError(record, f"expected a {REFERENCE_FORMAT} record (format, path, sha256)")
    target = (record.parent / raw["path"]).resolve()
    if verify:
        verify_digests(record, target, raw["sha256"], "the frozen file it references")
    return target


def verify_digests(record: str | Path, directory: str | Path, digests: dict, what: str) -> None:
    """Every ``{name: sha256}`` of ``digests`` is a file of ``directory`` with that SHA-256; a one-line
    error naming ``record`` (where the digests were recorded) and the file otherwise."""
    for name, digest in digests.items():
        f = Path(directory) / name
        if not f.is_file():
            raise NlaInputError(record, f"{what} is missing: {f}")
        if sha256_file(f) != digest:
            raise NlaInputError(record, f"{what} has changed since the checkpoint was written (SHA-256 differs): {f}")

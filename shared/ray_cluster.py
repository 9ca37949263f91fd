"""The Ray cluster a command runs in: the one ``ray job submit`` started, or a private one on loopback."""
from __future__ import annotations

import os
from pathlib import Path

# the directory that holds the nla_grpo package (a checkout's top, or site-packages): Ray's workers import it from there
_PARTS = Path(__file__).resolve().parents[1]
PROJECT_ROOT = _PARTS.parent if (_PARTS / "__init__.py").is_file() else _PARTS


# what the libraries print at start that a user of a run does not need (vLLM's warnings about its own
# settings, library deprecations, progress bars of loading a checkpoint); errors still show. Each can be set in
# the environment, and NLA_GRPO_VERBOSE=1 keeps them all.
QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning",
    "TQDM_DISABLE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
}


def quiet_env() -> dict:
    """``QUIET_ENV`` less what the environment sets itself; nothing with NLA_GRPO_VERBOSE=1."""
    if os.environ.get("NLA_GRPO_VERBOSE", "") not in ("", "0"):
        return {}
    return {k: v for k, v in QUIET_ENV.items() if k not in os.environ}


def start_ray() -> None:
    """Join the cluster a ``ray job submit`` runs in, or start a private local one. The command's own SIGTERM and
    SIGINT handlers (one line and exit 143 / 130) stay in place: ``ray.init`` installs a SIGTERM handler that
    aborts the process with a native stack dump."""
    import signal

    import ray

    if ray.is_initialized():
        return
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        _init_ray()
    finally:
        for sig, handler in handlers.items():
            if callable(handler):  # set again even where Python still reports it: Ray's handler is native
                signal.signal(sig, handler)


def _init_ray() -> None:
    import logging

    import ray

    quiet = quiet_env()
    level = logging.ERROR if quiet else logging.INFO  # Ray's own start-up lines in this process
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True, logging_level=level)
        return
    _loopback_only()
    path = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        # "local": always a private cluster; a bare init() would join any `ray start` cluster on this host
        address="local", include_dashboard=False, log_to_driver=True, logging_level=level,
        # vLLM's level: the user's, else quiet's ERROR, else (NLA_GRPO_VERBOSE=1) WARNING
        runtime_env={"env_vars": {"PYTHONPATH": path, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                                 "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"), **quiet}},
    )


def _loopback_only() -> None:
    """Keep the private cluster on loopback: every Ray socket (GCS, raylet, workers, agents) binds
    127.0.0.1, and the process groups' stores and gloo follow the node address Ray reports.

    Ray takes a node address of 127.0.0.1 only where it considers clusters unsupported (its
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` switch, off on Windows and macOS); anything else, even an
    explicit ``_node_ip_address="127.0.0.1"``, becomes the host's reachable address and its gRPC servers
    listen on every interface. The variable reaches the daemons and workers through the environment;
    the driver's own copy of the constant is set too, since ray may be imported already.
    """
    import ray._private.ray_constants as ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo would pick the hostname's interface


JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # what Ray's job supervisor hands the entrypoint of a submitted job


def submitted_copy() -> Path | None:
    """Under ``ray job submit --working-dir``: the directory Ray unpacked the upload into (the job's working
    directory, under Ray's session directory, deleted with it); None when not run so."""
    import json

    raw = os.environ.get(JOB_CONFIG_ENV)
    if not raw:
        return None
    try:
        runtime_env = json.loads(raw).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return None
    return Path.cwd().resolve() if runtime_env.get("working_dir") else None


def check_durable(run_dir, given: bool) -> None:
    """Refuse a run directory that would vanish with a submitted job (inside Ray's copy of the working
    directory), in one line, before anything is written; ``given``: it came from the command line."""
    from nla_grpo.shared.errors import NlaInputError

    copy = submitted_copy()
    if copy is None:
        return
    where = Path(run_dir).resolve()
    if not given or where == copy or copy in where.parents:
        raise NlaInputError(run_dir, f"resolves to {where}, inside Ray's temporary copy of the working directory, "
                                     "deleted with the job: under `ray job submit` pass --run-dir on storage that "
                                     "outlives it (an absolute path every node sees, e.g. /shared/runs/NAME)")

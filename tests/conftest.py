import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny model + RL parquet + sidecar, built once per test session (seed 0)."""
    from nla_grpo.dataprep.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("fixtures") / "tiny", seed=0)


# the settings of ``six_step_run`` and of every run compared with it: evals and checkpoints every 3 steps, and
# 16 prompts x 8 samples in micro-batches of 32 (two per rank when two ranks share them)
SHARED_RUN = ["--set", "logging.eval_every=3", "--set", "logging.eval_prompts=4", "--set", "checkpointing.every=3",
              "--set", "learner.micro_batch=32", "--set", "critic.micro_batch=32"]


def tiny_data(tiny_dir) -> list[str]:
    """The ``--set`` arguments that point a run at the tiny model and its RL parquet."""
    return ["--set", f"model.path={tiny_dir / 'model'}", "--set", f"data.parquet={tiny_dir / 'rl.parquet'}"]


@pytest.fixture(scope="session")
def six_step_run(tiny_dir, tmp_path_factory) -> Path:
    """Six steps of the tiny job with one learner rank, one engine and ``SHARED_RUN``'s settings, its
    checkpoints self-contained (the frozen reference copied into each): trained once per session for the
    tests that compare another run with it (a resumed one, a killed one, two ranks, two engines)."""
    run = tmp_path_factory.mktemp("shared") / "six"
    res = run_cli("train", ROOT / "deploy/tiny.yaml", "--run-dir", run, "--steps", "6", *tiny_data(tiny_dir), *SHARED_RUN,
                  "--set", "checkpointing.self_contained=true", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return run


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """``nla-grpo pipeline deploy/pipeline-tiny.yaml`` run once per session, as the README runs it: (run directory,
    the command's arguments, its stdout). Shared by the tests that only read its products."""
    out = tmp_path_factory.mktemp("pipe") / "run"
    args = ["pipeline", ROOT / "deploy/pipeline-tiny.yaml", "--run-dir", out]
    res = run_cli(*args, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out, args, res.stdout


def run_cli(*args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    """Run ``nla-grpo`` as a user would (a fresh process), capturing its output."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "nla_grpo.orchestrator.cli", *map(str, args)], cwd=cwd or ROOT, env=env,
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture(scope="module")
def ray_local():
    """A private 2-CPU Ray for one test module (actors import the project and the tests' helpers)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}})
    yield ray
    ray.shutdown()


def run_cli_together(*commands, timeout=900) -> list[subprocess.CompletedProcess]:
    """Run several ``nla-grpo`` commands at once, each a fresh process with its own private Ray, as two
    runs on one host would, and wait for all of them. A tiny job leaves one of two cores idle most of
    the time (each phase of a step runs in one process), so side by side they take less than in turn."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    outs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in commands]
    procs = [subprocess.Popen([sys.executable, "-m", "nla_grpo.orchestrator.cli", *map(str, args)], cwd=ROOT, env=env,
                              stdout=out, stderr=err, text=True) for args, (out, err) in zip(commands, outs)]
    deadline = time.time() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    done = []
    for proc, (out, err) in zip(procs, outs):
        with out, err:
            out.seek(0)
            err.seek(0)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read()))
    return done


def private_ray_dir() -> str:
    """A short temp root for one Ray cluster a test starts (``RAY_TMPDIR``): its processes name it on
    their command lines, so the test can stop that cluster alone (``ray stop`` would stop every Ray
    on the host, a user's own too). Short, because Ray's socket paths must stay under 108 bytes."""
    return tempfile.mkdtemp(prefix="nlaray", dir="/tmp")


def listening_sockets(pid: int) -> dict:
    """``{(ip, port): process name}`` for every TCP socket listening in ``pid`` and its descendants now."""
    import psutil

    found = {}
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return found
    for proc in procs:
        try:
            for c in proc.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    found[(c.laddr.ip, c.laddr.port)] = proc.name()
        except psutil.Error:  # gone meanwhile
            pass
    return found


def is_loopback(ip: str) -> bool:
    return ip == "::1" or ip.removeprefix("::ffff:").startswith("127.")


def stop_ray_in(temp_root: str) -> None:
    """Kill the processes of the Ray cluster whose temp root is ``temp_root``, then remove it."""
    needle = temp_root.encode()
    for _ in range(3):
        found = False
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == os.getpid():
                continue
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if needle in f.read():
                        os.kill(int(d), signal.SIGKILL)
                        found = True
            except (OSError, ProcessLookupError):
                pass
        if not found:
            break
        time.sleep(0.5)
    shutil.rmtree(temp_root, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

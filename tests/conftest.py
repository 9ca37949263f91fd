import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny model + RL parquet + sidecar, built once per test session (seed 0)."""
    from shared.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("fixtures") / "tiny", seed=0)


def run_cli(*args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    """Run ``nla-grpo`` as a user would (a fresh process), capturing its output."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *map(str, args)], cwd=cwd or ROOT, env=env,
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

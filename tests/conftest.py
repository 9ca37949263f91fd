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
        [sys.executable, "-m", "learner.cli", *map(str, args)], cwd=cwd or ROOT, env=env,
        capture_output=True, text=True, timeout=timeout,
    )

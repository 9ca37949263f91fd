"""Stopping a run from outside (Ctrl-C, SIGTERM) and a bad LoRA target: one line each, no traceback,
and the run directory still resumes."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, is_loopback, listening_sockets, run_cli, tiny_data

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("sig,code,ranks", [(signal.SIGINT, 130, 1), (signal.SIGTERM, 143, 2)])
def test_a_signal_stops_the_run_with_one_line_and_it_resumes(tiny_dir, tmp_path, sig, code, ranks):
    """Also: while it runs, nothing of the job (Ray's daemons and agents, the driver, every actor, vLLM,
    the data-parallel ranks' store and gloo) listens beyond loopback."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "nla_grpo.orchestrator.cli", "train", str(ROOT / "deploy/tiny.yaml"), "--run-dir", str(run),
           "--steps", "400", *tiny_data(tiny_dir), "--set", "logging.eval_every=0", "--set", "checkpointing.every=2",
           "--set", f"placement.learner_workers={ranks}", "--set", f"placement.critic_workers={ranks}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics, deadline, listening = run / "metrics.jsonl", time.time() + 600, {}
    while proc.poll() is None and time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        listening.update(listening_sockets(proc.pid))
        time.sleep(0.2)
    listening.update(listening_sockets(proc.pid))
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err[-3000:]
    lines = [l for l in err.splitlines() if l.startswith("nla-grpo: error")]
    assert len(lines) == 1 and f"interrupted ({signal.Signals(sig).name})" in lines[0], err[-3000:]
    assert lines[0].endswith(f"with `nla-grpo train --resume {run}`"), lines[0]  # the real run path, ready to paste
    assert "Traceback" not in err and "Stack trace" not in err and "*** SIG" not in err, err[-3000:]
    names = set(listening.values())
    assert {"gcs_server", "raylet"} <= names and any("RolloutActor" in n for n in names), listening
    assert [(a, n) for a, n in listening.items() if not is_loopback(a[0])] == []
    res = run_cli("train", "--resume", run, "--steps", "6", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[resume] from" in res.stdout


def test_a_bad_lora_target_stops_before_any_actor(tiny_dir, tmp_path):
    res = run_cli("train", ROOT / "deploy/tiny.yaml", "--run-dir", tmp_path / "r", *tiny_data(tiny_dir),
                  "--set", "learner.target_modules=[q_proj,bogus_proj]", timeout=300)
    assert res.returncode == 2 and "[ray]" not in res.stdout and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [
        res.stderr.strip()] and "learner.target_modules: ['bogus_proj'] not among the linear modules" in res.stderr
    assert not (tmp_path / "r").exists()


def test_a_learner_killed_while_the_services_start_is_one_line(tiny_dir, tmp_path):
    """The learner's process killed from outside as soon as it exists (while it loads): one line that
    names it, no traceback, and the new run leaves no directory behind."""
    import psutil

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "nla_grpo.orchestrator.cli", "train", str(ROOT / "deploy/tiny.yaml"), "--run-dir", str(run),
           "--steps", "4", *tiny_data(tiny_dir)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    killed, deadline = None, time.time() + 300
    while killed is None and proc.poll() is None and time.time() < deadline:
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                if "LearnerActor" in child.name():
                    child.kill()
                    killed = child.name()
                    break
        except psutil.Error:
            pass
        time.sleep(0.05)
    out, err = proc.communicate(timeout=300)
    assert killed is not None, err[-3000:]
    # Ray's own log lines (timestamped) and actors' prefixed output aside
    lines = [l for l in err.splitlines() if l.strip() and not re.match(r"\d{4}-\d\d-\d\d |\(", l)]
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("nla-grpo: error: ") and "learner" in lines[0] and "died" in lines[0], err[-3000:]
    assert not run.exists()

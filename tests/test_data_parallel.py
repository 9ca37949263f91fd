"""Data-parallel learner and critic ranks on the CPU (gloo): the same run as one rank, an exact
resume, one line for a rank that dies; and the pure parts (the deal, float64 gradient sums, rules)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, SHARED_RUN, run_cli, tiny_data
from nla_grpo.shared.collective import GradientSums, deal_micro_batches
from nla_grpo.shared.config import build_config
from nla_grpo.shared.errors import NlaInputError

TIMING = ("time/", "wall_s", "elapsed_s", "learner/tflops", "learner/tokens_per_s")
# SHARED_RUN's micro-batches, two per rank: the plan one rank makes, dealt over two
RANKS = ["--set", "placement.learner_workers=2", "--set", "placement.critic_workers=2"]


def _train(tiny_dir, run_dir, *extra, timeout=900):
    res = run_cli("train", ROOT / "deploy/tiny.yaml", "--run-dir", run_dir, *tiny_data(tiny_dir), *extra, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _metrics(run_dir):
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def _state(run_dir, step):
    d = run_dir / "checkpoints" / f"step_{step:06d}"
    return {**{f"policy/{k}": v for k, v in load_file(str(d / "policy" / "policy" / "adapter_model.safetensors")).items()},
            **{f"critic/{k}": v for k, v in load_file(str(d / "critic" / "critic_weights.safetensors")).items()}}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_ranks_give_the_one_rank_run_and_resume_exactly(tiny_dir, tmp_path, six_step_run):
    one, two, halves = six_step_run, tmp_path / "two", tmp_path / "halves"
    res = _train(tiny_dir, two, "--steps", "6", *SHARED_RUN, *RANKS)
    assert "placement.learner_workers" not in res.stderr
    a, b = _state(one, 6), _state(two, 6)
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    _assert_close(_metrics(one), _metrics(two))
    # 3 steps with 2 ranks, stop, resume with 2 ranks to 6: the straight 2-rank run
    _train(tiny_dir, halves, "--steps", "3", *SHARED_RUN, *RANKS)
    res = run_cli("train", "--resume", halves, "--steps", "6", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    c = _state(halves, 6)
    assert all(torch.equal(b[k], c[k]) for k in b) and _metrics(two) == _metrics(halves)


def _assert_close(rows_a, rows_b):
    """The same metrics: counts, flags and versions exactly, floats to fp32 rounding (one rank sums its
    micro-batches' gradients in fp32 as autograd does, several ranks in float64)."""
    assert len(rows_a) == len(rows_b) and all(a.keys() == b.keys() for a, b in zip(rows_a, rows_b))
    for a, b in zip(rows_a, rows_b):
        for k, x in a.items():
            if isinstance(x, float) and not isinstance(x, bool):
                assert x == pytest.approx(b[k], rel=1e-5, abs=1e-7), (a["step"], k, x, b[k])
            else:
                assert x == b[k], (a["step"], k, x, b[k])


def _learner_rank_pids() -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::LearnerActor"):
                        pids.append(int(d))
            except OSError:
                pass
    return pids


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_rank_that_dies_is_one_line_naming_it(tiny_dir, tmp_path):
    run = tmp_path / "killed"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "nla_grpo.orchestrator.cli", "train", str(ROOT / "deploy/tiny.yaml"), "--run-dir", str(run),
           "--steps", "200", "--set", f"model.path={tiny_dir / 'model'}", "--set", f"data.parquet={tiny_dir / 'rl.parquet'}",
           "--set", "logging.eval_every=0", "--set", "checkpointing.every=0", *RANKS]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    metrics = run / "metrics.jsonl"
    while proc.poll() is None and time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    pids = _learner_rank_pids()
    assert len(pids) == 2, pids
    os.kill(max(pids), signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    lines = [l for l in err.splitlines() if l.startswith("nla-grpo: error")]  # the rest is Ray's own log
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert "learner rank" in lines[0] and "of 2 died" in lines[0] and lines[0].startswith("nla-grpo: error: step "), lines[0]
    checkpoints = run / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())  # nothing half-written


def test_the_deal_balances_tokens_and_is_the_same_everywhere():
    tokens = [900, 100, 500, 500, 300, 700]
    deal = deal_micro_batches(tokens, 2)
    assert sorted(j for r in deal for j in r) == list(range(6))  # each micro-batch on exactly one rank
    assert [sum(tokens[j] for j in r) for r in deal] == [1500, 1500]
    assert deal == deal_micro_batches(list(tokens), 2) and all(r == sorted(r) for r in deal)
    assert deal_micro_batches([5], 3) == [[0], [], []]
    assert deal_micro_batches(tokens, 1) == [list(range(6))]


def test_float64_sums_do_not_depend_on_the_split():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(4096, generator=g) * 10 ** torch.randint(-6, 3, (4096,), generator=g) for _ in range(6)]
    p = torch.zeros(4096, requires_grad=True)

    class One:  # a DataParallel of one rank
        world_size = 1

        def sum_tensors(self, tensors):
            pass

    def summed(order):
        sums = GradientSums([p], several=True)
        for i in order:
            p.grad = grads[i].clone()
            sums.add()
        sums.finish(One())
        return p.grad.clone()

    assert torch.equal(summed(range(6)), summed([5, 3, 1, 0, 2, 4]))
    naive = sum(grads[i] for i in [5, 3, 1, 0, 2, 4])
    assert not torch.equal(sum(grads[i] for i in range(6)), naive)  # fp32 sums do depend on the order


@pytest.mark.parametrize("raw,needle", [
    ({"placement": {"mode": "colocated", "learner_workers": 2}, "critic": {"lora_r": 8}}, "expected placement.learner_workers=1"),
    ({"placement": {"mode": "split", "learner_workers": 2, "critic_workers": 3}}, "critic_workers=3 beside 2 learner rank"),
    ({"placement": {"learner_workers": 9}, "grpo": {"prompts_per_step": 1}, "rollout": {"group_size": 8}}, "every rank needs"),
    ({"placement": {"collective_timeout_s": 0}}, "placement.collective_timeout_s"),
])
def test_rank_settings_that_cannot_work_are_refused(raw, needle):
    with pytest.raises(NlaInputError, match=needle):
        build_config(raw, "c")


def test_gpus_needed_count_every_rank():
    from nla_grpo.orchestrator.placement import gpu_count_needed

    cfg = build_config({"placement": {"mode": "split", "learner_workers": 6, "critic_workers": 6}, "rollout": {"num_engines": 2}}, "c")
    assert gpu_count_needed(cfg) == 8
    cfg = build_config({"placement": {"mode": "split", "learner_workers": 2, "critic_workers": 2, "critic_own_gpu": True},
                        "rollout": {"num_engines": 1, "tensor_parallel_size": 2}}, "c")
    assert gpu_count_needed(cfg) == 6

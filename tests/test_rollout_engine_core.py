"""rollout.engine_core: own_process — vLLM's engine core in its own process samples what the engine in the
actor samples (fp32, CPU), pushes included, with either rollout.lora; the field's rules and environment."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

# Run in a fresh interpreter: which process an engine core uses is read from the environment when the
# engine starts, and this test process's earlier engines keep theirs in process.
SCRIPT = r"""
import json, sys
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/tests"]
from pathlib import Path
from rollout_support import max_abs_diff, tiny_config, tiny_requests, update_for, vectors_of
from nla_grpo.shared.spec import load_spec, sidecar_path
from nla_grpo.rollout.hf_engine import HfEngine
from nla_grpo.rollout.vllm.handles import engine_in_process
from nla_grpo.rollout.vllm.engine import VllmEngine

tiny = Path(sys.argv[1])
spec = load_spec(sidecar_path(tiny / "rl.parquet"))
out = {}
for lora in ("adapter", "merged"):
    cfg = tiny_config(tiny, None, "host", group_size=4, max_new_tokens=12, lora=lora, engine_core="own_process")
    engine, hf = VllmEngine(cfg, spec), HfEngine(cfg, spec)
    try:
        reqs = tiny_requests(tiny / "rl.parquet", spec, engine.tokenizer, 3, prefill=cfg.rollout.prefill)
        update = update_for(cfg, 1, seed=4)
        engine.load_adapter(update)
        hf.load_adapter(update)
        samples = engine.generate(reqs, seed=2)
        again = engine.generate(reqs, seed=2)
        out[lora] = {"in_process": engine_in_process(engine.llm), "version": sorted({s.adapter_version for s in samples}),
                     "diff": max_abs_diff(samples, hf.recompute_logprobs(samples, vectors_of(samples, reqs))),
                     "repeat": [s.response_ids for s in samples] == [s.response_ids for s in again]}
    finally:
        engine.close()
        hf.close()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_engine_core_in_its_own_process_samples_what_the_learner_computes(tiny_dir):
    pytest.importorskip("vllm")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_dir), str(ROOT)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=560)
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    for lora in ("adapter", "merged"):
        got = out[lora]
        assert not got["in_process"] and got["version"] == [1] and got["repeat"], (lora, got)
        assert got["diff"] <= 1e-4, (lora, got)  # the pushed adapter reached the worker in the other process


def test_own_process_overrides_an_in_process_default_but_defaults_do_not(monkeypatch):
    from nla_grpo.rollout.vllm.env import prepare_engine_env

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # an earlier engine of this process
    prepare_engine_env(cpu=True, in_process=False, ship_callables=True, own_process=True)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    prepare_engine_env(cpu=True, in_process=True)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"  # a default never overrides what is set


def test_own_process_needs_the_vllm_backend():
    from nla_grpo.shared.config import build_config
    from nla_grpo.shared.errors import NlaInputError

    with pytest.raises(NlaInputError, match="rollout.engine_core=own_process .* needs rollout.backend=vllm, found hf"):
        build_config({"rollout": {"engine_core": "own_process", "backend": "hf"}})
    assert build_config({"rollout": {"engine_core": "own_process"}}).rollout.engine_core == "own_process"

"""``nla-grpo pipeline deploy/pipeline-tiny.yaml`` end to end on the CPU, as the README runs it: the tiny
fixture, extraction, the fixture's teacher (a real HTTP server on loopback, started by ``data explain``),
AV-SFT, AR-SFT and RL from their products, each writing its output under the run directory.

The NLA it hands back works (*ceiling* being AR-SFT's last held-out FVE, the reconstructor on the teacher's own
explanations): RL's step-0 held-out FVE, before any update, is at least 0.6 x ceiling (it was -0.003 when the
pipeline's AV-SFT stopped where its samples were wrong half the time); RL ends above its step 0 (by 0.02, twice
an eval's noise) and at 0.75 x ceiling; no held-out eval falls 0.1 below step 0; the last step's explanations
are non-empty; the run prints no health line, and a summary line per stage.
The same products trained at the demo's from-scratch rates print the health line within five steps.

Run again, every stage is skipped; another ``extract.layer`` on the same directory is refused in one
line; a stage output of the wrong kind is one line; without a teacher for real data, one line."""
import json
import re
import signal
import subprocess
import sys
import os

import pytest

from conftest import ROOT, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the whole pipeline runs in the first test


def _metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def pipeline(tiny_pipeline):
    return tiny_pipeline


def test_the_pipeline_hands_back_a_working_nla(pipeline):
    out, _, stdout = pipeline
    for path in ("tiny/subject/config.json", "data/rl.parquet", "data/av_sft.explained.parquet",
                 "data/ar_sft.explained.parquet", "sft_av/adapter/adapter_model.safetensors",
                 "sft_ar/critic/critic_meta.json", "rl/config.yaml", "pipeline.json"):
        assert (out / path).is_file(), path
    sidecar = (out / "data" / "av_sft.explained.parquet.nla_meta.yaml").read_text()
    assert "teacher_model: tiny-fixture-rule" in sidecar and "prompt_version" in sidecar
    av = [r for r in _metrics(out / "sft_av" / "metrics.jsonl") if "eval/nll" in r]
    assert av[-1]["eval/nll"] < 0.1 * av[0]["eval/nll"], av
    ar = [r for r in _metrics(out / "sft_ar" / "metrics.jsonl") if "eval/fve" in r]
    ceiling = ar[-1]["eval/fve"]
    assert ar[0]["eval/fve"] < 0 < 0.5 < ceiling, ar
    config = (out / "rl" / "config.yaml").read_text()
    assert str(out / "sft_av" / "adapter") in config and str(out / "sft_ar" / "critic") in config

    rl = _metrics(out / "rl" / "metrics.jsonl")
    evals = [r for r in rl if "eval/fve" in r]
    step0, last = evals[0], evals[-1]
    assert step0["step"] == 0 and [r["step"] for r in rl if "fve" in r] == list(range(1, 101))
    fves = [round(r["eval/fve"], 3) for r in evals]
    assert step0["eval/fve"] >= 0.6 * ceiling, (fves, ceiling)
    assert last["eval/fve"] >= max(step0["eval/fve"] + 0.02, 0.75 * ceiling), (fves, ceiling)
    assert min(r["eval/fve"] for r in evals) >= step0["eval/fve"] - 0.1, fves
    assert 1 - rl[-1]["empty_rate"] >= 0.95 and last["eval/nonempty_rate"] >= 0.95
    assert "[health]" not in stdout and not any(r.get(k) for r in rl for k in r if k.startswith("health/"))
    summary = [line for line in stdout.splitlines() if line.startswith("[summary]")]
    assert [line.split(":")[0] for line in summary] == ["[summary] AV-SFT", "[summary] AR-SFT", "[summary] RL"], summary
    assert f"{ceiling:.3f} at step {ar[-1]['step']}" in summary[1]
    assert f"held-out FVE {step0['eval/fve']:+.3f} at step 0" in summary[2]
    assert f"{last['eval/fve']:+.3f} at step 100" in summary[2]


def sample_the_products(out, seed=0):
    """The pipeline's SFT products on RL's held-out rows, as RL's step 0 sees them: the AV-SFT adapter sampled
    once per row at temperature 1 (HF, the RL prompt table and injection), its explanations scored by the AR-SFT
    critic. Returns (the share that is the teacher's explanation of the row, FVE of the AR on them)."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from nla_grpo.critic.scoring import Critic
    from nla_grpo.dataprep.explain import classify_reply, teacher_prompt
    from nla_grpo.dataprep.fixture_teacher import fixture_reply
    from nla_grpo.learner.reward import explanation_for
    from nla_grpo.orchestrator.job import prepare_job
    from nla_grpo.rollout.engine import stop_token_ids
    from nla_grpo.shared.config import load_config
    from nla_grpo.shared.injection import embed_batch, embed_norm
    from nla_grpo.shared.schema import fve

    cfg = load_config(out / "rl" / "config.yaml")
    job = prepare_job(cfg, log=lambda *a: None)
    table = pq.read_table(cfg.data.parquet, columns=["detokenized_text_truncated", "activation_token"]).to_pydict()
    rows = job.eval.row_ids
    teacher = [classify_reply(fixture_reply(teacher_prompt(table["detokenized_text_truncated"][r], table["activation_token"][r])[1]))[0]
               for r in rows]
    vectors = torch.from_numpy(np.array(job.eval.activations))
    base = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, cfg.learner.adapter_init).eval()
    scale = job.spec.injection_scale(cfg.injection.scale, embed_norm=embed_norm(base.get_input_embeddings().weight))
    stops = stop_token_ids(cfg.model.path, job.tokenizer, cfg.rollout.extra_stop_tokens)
    torch.manual_seed(seed)
    said = []
    for i in range(len(rows)):
        ids, site = job.prompt_ids[int(job.prompt_index_eval[i])]
        x = torch.tensor([ids])
        embeds = embed_batch(x, model.get_input_embeddings(), torch.tensor([site]), vectors[i:i + 1], scale)
        with torch.no_grad():
            new = model.generate(inputs_embeds=embeds, attention_mask=torch.ones_like(x), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=cfg.rollout.max_new_tokens, eos_token_id=stops,
                                 pad_token_id=stops[0])[0].tolist()
        text = cfg.rollout.prefill + job.tokenizer.decode(new, skip_special_tokens=True)
        said.append(explanation_for(text, "stop" if new and new[-1] in stops else "length", False, cfg.rollout.cap_is_failure))
    mses = Critic(job.cfg, job.spec).score(said, vectors)
    scored = [m for m in mses if m is not None]
    return sum(a == b for a, b in zip(said, teacher)) / len(rows), fve(sum(scored) / len(scored), job.fve_baseline)


def test_the_sft_verbaliser_samples_what_the_reconstructor_reads(pipeline):
    """The cold start's cause: RL samples the AV-SFT adapter at temperature 1, and an explanation naming the wrong
    token costs the AR about twice the mean predictor's error, so the pair starts at FVE ~0 unless AV-SFT ends
    sharp. The pipeline's AV-SFT once stopped at a held-out NLL of 0.38, its samples the teacher's on 56% of
    RL's held-out rows, and the AR scored those samples at FVE -0.01 (0.63 on the teacher's own text)."""
    out, _, _ = pipeline
    ceiling = [json.loads(line) for line in (out / "sft_ar" / "metrics.jsonl").read_text().splitlines()][-1]["eval/fve"]
    right, fve = sample_the_products(out)
    assert right >= 0.85 and fve >= 0.6 * ceiling, (right, fve, ceiling)


def test_rl_at_a_fresh_adapters_rate_prints_the_health_line(pipeline, tmp_path):
    out, _, _ = pipeline
    cfg = out / "rl" / "config.yaml"
    # the demo's from-scratch RL settings (deploy/tiny.yaml) on the SFT products
    res = run_cli("train", cfg, "--run-dir", tmp_path / "hot", "--steps", "5", "--set", "learner.lr=3e-3",
                  "--set", "critic.lr=1e-3", "--set", "grpo.prompts_per_step=16", "--set", "logging.eval_every=0",
                  "--set", "checkpointing.every=0", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    health = [line for line in res.stdout.splitlines() if line.startswith("[health]")]
    assert health and int(re.match(r"\[health\] step (\d+): ", health[0]).group(1)) <= 5, res.stdout[-3000:]
    assert "KL to the reference" in health[0] and "lower learner.lr" in health[0]


def test_a_second_run_skips_every_stage(pipeline):
    out, args, _ = pipeline
    again = run_cli(*args, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    for stage in ("tiny fixture", "extract", "sft av", "sft ar", "train"):
        line = again.stdout.split(f"[pipeline] {stage}: ")[1].splitlines()[0]
        assert "skipped" in line, line
    assert "[explain] av_sft" in again.stdout and "already" in again.stdout
    assert "[summary] RL: held-out FVE" in again.stdout


def test_another_layer_on_the_same_run_directory_is_refused_in_one_line(pipeline):
    out, args, _ = pipeline
    before = (out / "pipeline.json").read_text()
    res = run_cli(*args, "--set", "extract.layer=1", timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith("nla-grpo: error: extract.layer: 0 when ") and "1 now" in lines[0], lines
    assert (out / "pipeline.json").read_text() == before and "[pipeline]" not in res.stdout


def test_a_stage_output_of_the_wrong_kind_is_one_line(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "data").write_text("not the splits")
    res = run_cli("pipeline", ROOT / "deploy/pipeline-tiny.yaml", "--run-dir", tmp_path / "p")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "data: not a directory" in lines[0], res.stderr
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["data"]


def test_a_pipeline_for_real_data_without_a_teacher_is_one_line(tmp_path):
    res = run_cli("pipeline", ROOT / "deploy/pipeline-tiny.yaml", "--run-dir", tmp_path / "p", "--set", "tiny_fixture=false")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "explain.base_url" in lines[0], res.stderr
    assert not (tmp_path / "p").exists()


def test_config_check_on_a_pipeline_file_says_to_run_the_pipeline():
    res = run_cli("config", "check", ROOT / "deploy/pipeline-tiny.yaml")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "a pipeline file" in lines[0] and "nla-grpo pipeline" in lines[0] and "unknown" not in lines[0]


def _popen(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "nla_grpo.orchestrator.cli", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_signal_during_sft_is_one_line_naming_the_resume(pipeline, tmp_path):
    out, _, _ = pipeline
    run = tmp_path / "av"
    proc = _popen("sft", "av", out / "rl" / "config.yaml", "--run-dir", run, "--steps", "40",
                  "--set", "learner.adapter_init=null", "--set", "critic.checkpoint=null",
                  "--set", "sft.av.checkpoint_every=10", "--set", "sft.av.eval_every=0")
    for line in proc.stdout:  # the first checkpoint is written after step 10's line
        if line.startswith("[av] step 20/"):
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and len(err.strip().splitlines()) == 1, (proc.returncode, err[-2000:])
    assert "interrupted (SIGTERM)" in err and f"`nla-grpo sft av --resume {run}`" in err, err
    res = run_cli("sft", "av", "--resume", run, timeout=600)
    assert res.returncode == 0 and "[resume] AV-SFT from step_0000" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]

"""benchmarks/gpu_timeline.py: the GPU's busy share and its idle gaps, blamed on the host ops that ran then;
benchmarks/gpu_monitor.py: what nvidia-smi reported meanwhile."""
import sys
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_timeline import Span, idle_gaps, merge, spans_from_profiler, timeline_report  # noqa: E402


def test_merge_joins_overlapping_and_touching_intervals():
    spans = [Span("a", 5, 7), Span("b", 0, 2), Span("c", 1, 3), Span("d", 3, 4), Span("e", 6, 6.5)]
    assert merge(spans) == [(0, 4), (5, 7)]


def test_idle_gaps_are_the_window_minus_the_device_spans():
    device = [Span("k1", 10, 20), Span("k2", 15, 30), Span("k3", 50, 60)]
    assert idle_gaps(device, (0, 100)) == [(0, 10), (30, 50), (60, 100)]
    assert idle_gaps(device, (12, 55)) == [(30, 50)]  # clipped to the window
    assert idle_gaps([], (0, 5)) == [(0, 5)]


def test_report_blames_each_gap_on_the_host_ops_that_overlapped_it():
    # GPU: busy 0-100 and 300-400; the host synced (item) during 100-200, then built a batch 200-300
    device = [Span("gemm", 0, 100), Span("gemm", 300, 400)]
    host = [Span("aten::mm", 0, 20), Span("aten::item", 90, 200), Span("pack_rows", 200, 300)]
    rep = timeline_report(device, host, (0, 400), min_gap_us=10)
    assert rep["busy"] == pytest.approx(0.5) and rep["idle_ms"] == pytest.approx(0.2)
    assert rep["idle_by_op"] == {"aten::item": 0.1, "pack_rows": 0.1}
    (gap,) = rep["gaps"]
    assert gap["at_ms"] == pytest.approx(0.1) and gap["ms"] == pytest.approx(0.2)
    assert set(gap["host_ops"]) == {"aten::item", "pack_rows"} and gap["ended_by"] == "gemm"


def test_report_lists_the_longest_gaps_first_and_skips_short_ones():
    device = [Span("k", 0, 10), Span("k", 20, 30), Span("k", 130, 140), Span("k", 141, 150)]
    rep = timeline_report(device, [], (0, 150), min_gap_us=5)
    assert [g["ms"] for g in rep["gaps"]] == [pytest.approx(0.1), pytest.approx(0.01)]  # the 1 µs gap left out
    assert rep["idle_by_op"] == {"(no host op)": pytest.approx(0.111)}


def test_spans_come_from_a_real_profile():
    import torch
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (x @ x).sum().item()
    device, host = spans_from_profiler(prof)
    names = {s.name for s in host}
    assert not device and {"aten::matmul", "aten::sum", "aten::item"} <= names  # outermost ops only: no aten::mm
    assert "aten::mm" not in names and all(s.end > s.start for s in host)


def test_smi_poll_summarises_each_field_and_skips_unreadable_rows():
    from gpu_monitor import SmiPoll

    rows = "print('100, 1980, 500.5'); print('[N/A], 1, 2'); print('300, 1500, 690'); print('200, 1700, 650')"
    with SmiPoll(command=[sys.executable, "-c", rows]) as poll:
        poll.proc.wait()
    s = poll.summary()
    assert s["memory.used"] == {"median": 200.0, "min": 100.0, "max": 300.0}
    assert s["clocks.sm"]["median"] == 1700.0 and s["power.draw"]["max"] == 690.0
    assert len(poll.times) == len(poll.rows) == 3 and poll.times == sorted(poll.times)  # each kept row, when it came


def test_smi_poll_without_nvidia_smi_gives_nan():
    import math

    from gpu_monitor import SmiPoll

    with SmiPoll(command=["/nonexistent/nvidia-smi"]) as poll:
        pass
    assert all(math.isnan(v) for f in poll.summary().values() for v in f.values())


def test_device_time_is_summed_by_kind_of_kernel():
    from gpu_timeline import Span, device_time_by_kind, kernel_kind

    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert kernel_kind("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT") == "matmul"
    assert kernel_kind("void flash::flash_fwd_splitkv_kernel<...>") == "attention"
    assert kernel_kind("void vllm::reshape_and_cache_flash_kernel<...>") == "attention"
    assert kernel_kind("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>") == "sampling"
    assert kernel_kind("noise") == "sampling"
    assert kernel_kind("Memcpy HtoD (Pinned -> Device)") == "copy"
    assert kernel_kind("triton_red_fused_add_mul_rms_norm_0") == "elementwise"
    spans = [Span("sm90_xmma_gemm", 0, 3000), Span("flash_fwd", 3000, 4000), Span("sm90_xmma_gemm", 5000, 6000),
             Span("rms_norm_kernel", 6000, 6500)]
    rep = device_time_by_kind(spans, top=2)
    assert rep["ms"] == {"matmul": 4.0, "attention": 1.0, "elementwise": 0.5}
    assert list(rep["ms"]) == ["matmul", "attention", "elementwise"]  # the largest first
    assert rep["top_kernels_ms"] == {"sm90_xmma_gemm": 4.0, "flash_fwd": 1.0}


def test_the_peak_of_each_phase_comes_from_the_polls_inside_its_windows():
    from gpu_monitor import peak_by_phase

    timeline = [{"step": 2, "phases": [["rollout", 10.0, 20.0], ["update", 20.0, 40.0]]},
                {"step": 3, "phases": [["rollout", 40.0, 50.0], ["update", 50.0, 70.0], ["push", 70.0, 70.1]]}]
    times = [5.0, 12.0, 19.0, 25.0, 45.0, 60.0, 80.0]
    values = [999.0, 30.0, 35.0, 80.0, 50.0, 70.0, 999.0]  # the polls before and after the steps count nowhere
    assert peak_by_phase(times, values, timeline) == {"rollout": 50.0, "update": 80.0}  # no poll fell in push


def test_each_services_processes_are_summed_per_poll_and_peaked_per_phase():
    from gpu_monitor import peak_by_phase_per_process

    timeline = [{"step": 2, "phases": [["rollout", 10.0, 20.0], ["update", 20.0, 40.0]]}]
    # polls at 11, 15 and 25 s; the engine runs in two processes (11 and 12), pid 99 is another program
    times = [11.0, 11.001, 11.002, 11.003, 15.0, 15.001, 15.002, 25.0, 25.001, 25.002]
    rows = [(10, 8000.0), (11, 30000.0), (12, 2000.0), (99, 500.0),
            (10, 8100.0), (11, 31000.0), (12, 2500.0),
            (10, 40000.0), (11, 1000.0), (12, 1000.0)]
    peaks = peak_by_phase_per_process(times, rows, timeline, {10: "learner", 11: "engines", 12: "engines"})
    assert peaks == {"rollout": {"learner": 8100.0, "engines": 33500.0, "other": 500.0},
                     "update": {"learner": 40000.0, "engines": 2000.0}}


def test_the_colocated_job_benchmark_runs_the_shipped_config():
    """benchmarks/job_benchmark.py's colocated job is deploy/colocated.yaml with only the paths, the batch and the
    workload's shape changed (and what the command line names), so its figures are the shipped config's."""
    import argparse

    import yaml

    import job_benchmark
    from nla_grpo.shared.config import build_config

    ap = argparse.ArgumentParser()
    job_benchmark.step_benchmark.add_workload_args(ap, steps=3)
    ap.set_defaults(vllm_mem=None, micro_batch=None, placement="colocated", sleep=None, overlap=False, engines=None,
                    no_prefix_caching=False, nf4_fp32_modules=False, tis_cap=None, engine_option=[],
                    **{flag[2:].replace("-", "_"): None for flag, *_ in job_benchmark.CHOICES})
    args = ap.parse_args(["--prompts", "64"])
    deploy = yaml.safe_load(job_benchmark.DEPLOY.read_text())
    cfg = job_benchmark.job_config(Path("/work"), args)
    changed = {(s, k) for s in set(cfg) | set(deploy) for k in set(cfg.get(s) or {}) | set(deploy.get(s) or {})
               if (cfg.get(s) or {}).get(k) != (deploy.get(s) or {}).get(k)}
    allowed = {("model", "path"), ("data", "parquet"), ("data", "max_rows"), ("data", "eval_fraction"),
               ("data", "fve_baseline_rows"), ("critic", "checkpoint"), ("critic", "num_layers"), ("learner", "adapter_init"),
               ("learner", "lora_r"), ("rollout", "group_size"), ("rollout", "max_new_tokens"), ("rollout", "prefill"),
               ("rollout", "cap_is_failure"), ("prompts", "enable_thinking"), ("grpo", "steps"),
               ("grpo", "prompts_per_step"), ("logging", "eval_every")}
    assert changed <= allowed, changed - allowed
    assert cfg["grpo"]["prompts_per_step"] == 64 and cfg["placement"] == deploy["placement"]
    assert cfg["learner"] == {k: v for k, v in deploy["learner"].items() if k != "adapter_init"}
    resolved = build_config(cfg)
    assert resolved.rollout.lora == "merged" and resolved.rollout.gpu_memory_utilization == "auto"
    named = ap.parse_args(["--prompts", "64"])
    named.lora, named.quantization = "adapter", "nf4"
    cfg = job_benchmark.job_config(Path("/work"), named)
    assert cfg["rollout"]["lora"] == "adapter" and cfg["model"]["quantization"] == "nf4"

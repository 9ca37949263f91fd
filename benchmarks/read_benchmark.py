"""Reading speed of a trained NLA on one GPU: vectors read per second (verbalise up to 150 tokens + reconstruct).

The Qwen3-8B shape with random weights (``step_benchmark.build_workdir``), laid out as an export's verbaliser and
reconstructor pair (``OUT/verbalizer`` with its ``nla_meta.yaml``, a LoRA critic of 25 blocks in ``OUT/critic``),
loaded with ``nla_grpo.NLA`` as ``nla-grpo read`` loads it: vLLM holds the GPU beside the reconstructor (nothing
trains). Random weights never write ``</explanation>``: every explanation runs to the token cap, the longest
reading there is (the JSON records the decoded lengths). Most of the 152k ids they draw lie past the benchmark's
small tokenizer and decode to nothing, so the reconstructor is timed twice: on what was said (short texts) and on
texts of the cap's length drawn from the tokenizer's words, the longest reading; vectors per second count the
latter. The first call (CUDA graphs, compilation) is left out.

    python benchmarks/read_benchmark.py --out benchmarks/results/h200-read-8b.json
    python benchmarks/read_benchmark.py --lora adapter --vector-input prompt_embeds --out ...  # the run config's route
    python benchmarks/read_benchmark.py --critic-lora adapter --out ...  # the reconstructor's adapters beside its base
    python benchmarks/read_benchmark.py --profile benchmarks/results/h200-read-critic-profile.txt --out ...
    python benchmarks/read_benchmark.py --device cpu --layers 2 --vectors 16 --new-tokens 8 --out /tmp/read.json  # a dry run

``--profile PATH`` writes a torch-profiler kernel table of one reconstructor micro-batch on cap-length texts (PATH)
and its timeline (``PATH``'s stem + ``-timeline.txt``: how busy the GPU was, and where it idled); the verbaliser's
kernels run in vLLM's engine process, out of this profiler's sight.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def build_pair(work: Path, layers: int, critic_layers: int, new_tokens: int, device: str) -> Path:
    """``work/nla``: the random model as the verbaliser (its files linked) with the sidecar, and a critic checkpoint."""
    import yaml

    import step_benchmark
    from nla_grpo.shared.config import build_config
    from nla_grpo.shared.spec import load_spec

    step_benchmark.DEVICE = device
    step_benchmark.build_workdir(work, step_benchmark.QWEN3_8B if device == "cuda" else step_benchmark.SMALL, layers, 8, 200, 0)
    pair = work / "nla"
    verbalizer = pair / "verbalizer"
    if not (pair / "critic" / "critic_meta.json").is_file():
        verbalizer.mkdir(parents=True, exist_ok=True)
        for f in (work / "model").iterdir():
            if not (verbalizer / f.name).exists():
                os.symlink(f.resolve(), verbalizer / f.name)
        meta = yaml.safe_load((work / "rl.parquet.nla_meta.yaml").read_text())
        meta["base_model"] = str((work / "model").resolve())
        meta["fve_baseline"] = {"rawvar": 1.0}  # random unit-scaled vectors: the mean predictor's MSE is about 1
        meta["injection"] = {"mode": "embed", "scale": meta["extraction"].get("injection_scale", "embed_norm")}
        meta["generation"] = {"prefill": "<explanation>", "extra_stop_tokens": [], "max_new_tokens": new_tokens,
                              "cap_is_failure": False, "enable_thinking": False}
        (verbalizer / "nla_meta.yaml").write_text(yaml.safe_dump(meta, allow_unicode=True))
        from nla_grpo.critic.scoring import Critic

        spec = load_spec(verbalizer / "nla_meta.yaml")
        cfg = build_config({"model": {"path": str(work / "model"), "dtype": "bfloat16" if device == "cuda" else "float32"},
                            "data": {"parquet": str(work / "rl.parquet")},
                            "critic": {"num_layers": critic_layers, "lora_r": 16, "lora_alpha": 16}, "placement": {"mode": "cpu"}})
        Critic(cfg, spec, device=device).save(pair / "critic", optimizer=False)
    return pair


def profile_reconstructor(nla, texts: list[str], out: Path, device: str) -> dict:
    """A kernel table and the GPU's busy share over one micro-batch of the reconstructor on ``texts``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import gpu_timeline

    critic = nla.critic
    ids = [x for x in critic.encode(texts[: critic.cfg.critic.micro_batch]) if x is not None]
    cuda = device.startswith("cuda")
    critic.predict_ids(ids)  # warm: the profiled pass repeats it
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        critic.predict_ids(ids)
        if cuda:
            torch.cuda.synchronize()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=40))
    device_spans, host_spans = gpu_timeline.spans_from_profiler(prof)
    timeline = gpu_timeline.timeline_report(device_spans, host_spans)
    out.with_name(out.stem + "-timeline.txt").write_text(gpu_timeline.format_report(timeline) + "\n")
    tokens = sum(len(x) for x in ids)
    print(f"[profile] one micro-batch of {len(ids)} texts, {tokens} tokens: GPU busy {timeline['busy']:.1%} "
          f"of {timeline['window_ms']:.0f} ms", flush=True)
    return {"texts": len(ids), "tokens": tokens, "file": str(out), **{k: timeline[k] for k in ("busy", "window_ms")},
            "device_time_by_kind": gpu_timeline.device_time_by_kind(device_spans)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/nla-read-bench")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--critic-layers", type=int, default=25)
    ap.add_argument("--vectors", type=int, default=2048, help="vectors read in the timed call")
    ap.add_argument("--samples", type=int, default=1, help="explanations per vector")
    ap.add_argument("--new-tokens", type=int, default=150)
    ap.add_argument("--gpu-share", type=float, default=0.6, help="vLLM's share of the GPU (the rest: the reconstructor)")
    ap.add_argument("--max-batch", type=int, default=512, help="samples vLLM decodes at once")
    ap.add_argument("--lora", default="auto", choices=["auto", "adapter", "merged"], help="the engine's adapter route (NLA's lora)")
    ap.add_argument("--vector-input", default="auto", choices=["auto", "prompt_embeds", "multimodal"],
                    help="how the vector reaches the engine (NLA's vector_input)")
    ap.add_argument("--critic-lora", default="merged", choices=["merged", "adapter"],
                    help="the reconstructor's LoRA folded into its base (NLA's default) or beside it, as in training")
    ap.add_argument("--profile", help="write a kernel table of one reconstructor micro-batch here")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import numpy as np
    import torch

    from nla_grpo.nla import NLA
    from nla_grpo.parts import locate

    t0 = time.time()
    pair = build_pair(Path(args.workdir), args.layers, args.critic_layers, args.new_tokens, args.device)
    t_build = time.time() - t0
    parts = locate(pair)
    nla = NLA(parts, device=args.device, backend="vllm" if args.device.startswith("cuda") else "hf",
              gpu_share=args.gpu_share, max_batch=args.max_batch, lora=args.lora, vector_input=args.vector_input,
              critic_lora=args.critic_lora)
    d = parts.spec.d_model
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((args.vectors, d)).astype(np.float32)
    t = time.time()
    warm = nla.verbalize(vectors[: min(64, args.vectors)], samples=args.samples)
    nla.score([e[0] for e in warm], vectors[: len(warm)])
    t_warm = time.time() - t
    # texts of the cap's length in the tokenizer's own words: what the reconstructor reads at the longest
    special = set(nla.tokenizer.all_special_ids)
    words = [i for i in range(len(nla.tokenizer)) if i not in special]
    def capped_text() -> str:  # drawn ids, decoded, re-encoded and cut to the cap (a decoded id may re-encode as several)
        text = nla.tokenizer.decode(rng.choice(words, args.new_tokens).tolist())
        return nla.tokenizer.decode(nla.tokenizer.encode(text, add_special_tokens=False)[: args.new_tokens])

    capped = [capped_text() for _ in range(args.vectors * args.samples)]
    capped_tokens = float(np.mean([len(nla.tokenizer.encode(t)) for t in capped[:64]]))
    # what the engine decoded (untimed): response lengths and finish reasons of 64 requests
    from nla_grpo.shared.types import PromptRequest

    prompt, site = nla._prompt_ids()
    probe = nla._engine_for(args.samples).generate(
        [PromptRequest(i, list(prompt), site, torch.from_numpy(vectors[i].copy())) for i in range(min(64, args.vectors))], seed=7)
    decoded = {"mean_response_tokens": round(float(np.mean([len(x.response_ids) for x in probe])), 1),
               "finished_by_length": round(float(np.mean([x.finish_reason == "length" for x in probe])), 3)}
    print(json.dumps({"decoded_first64": decoded, "capped_text_tokens_first64": round(capped_tokens, 1)}), flush=True)
    runs = []
    for r in range(args.repeats):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.time()
        said = nla.verbalize(vectors, samples=args.samples, seed=r + 1, ids=range(args.vectors))
        t_verbalize = time.time() - t
        flat = [e for group in said for e in group]
        golds = np.repeat(vectors, args.samples, axis=0)
        t = time.time()
        mses = nla.score(flat, golds)
        t_score_said = time.time() - t
        t = time.time()
        mses_cap = nla.score(capped, golds)
        t_score = time.time() - t
        runs.append({"verbalize_s": round(t_verbalize, 3), "reconstruct_said_s": round(t_score_said, 3),
                     "reconstruct_at_cap_s": round(t_score, 3),
                     "vectors_per_s": round(args.vectors / (t_verbalize + t_score), 1),
                     "scored": sum(m is not None for m in mses), "scored_at_cap": sum(m is not None for m in mses_cap),
                     "said_tokens_mean_first64": round(sum(len(nla.tokenizer.encode(e or "")) for e in flat[:64])
                                                       / min(64, len(flat)), 1)})
        print(json.dumps(runs[-1]), flush=True)
    profiled = profile_reconstructor(nla, capped, Path(args.profile), args.device) if args.profile else None
    result = {
        "what": "nla_grpo.NLA reading on one GPU: verbalise (vLLM) + reconstruct (critic), vectors per second",
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "shape": f"Qwen3-8B shape, {args.layers} blocks, random bf16 weights; critic {args.critic_layers} blocks LoRA r=16",
        "vectors": args.vectors, "samples": args.samples, "new_tokens": args.new_tokens, "gpu_share": args.gpu_share,
        "max_batch": args.max_batch, "route": nla.route(), "critic_lora": args.critic_lora, "engine": nla._engine.describe() if nla._engine is not None else None,
        "build_s": round(t_build, 1), "first_call_s": round(t_warm, 1), "decoded_first64": decoded,
        "capped_text_tokens_first64": round(capped_tokens, 1), "runs": runs,
        "vectors_per_s_best": max(r["vectors_per_s"] for r in runs),
        "reconstructor_profile": profiled,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), flush=True)
    nla.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

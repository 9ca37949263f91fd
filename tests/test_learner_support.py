"""Helpers for the learner tests (config, synthetic rollouts), and checks that the helpers are sound.

Synthetic samples come from an independent sampler: the plain HF model with the shared injection,
one full forward per token. With a fresh LoRA (B = 0) the learner's policy equals that model, so
their logprobs must agree: a check of the learner's padding, positions and injection.
"""
from __future__ import annotations

import torch

from nla_grpo.shared.types import Sample


def make_cfg(tiny_dir, mode: str = "embed", placement: str = "cpu", *, dtype: str = "float32", **learner):
    from nla_grpo.shared.config import build_config

    raw = {
        "placement": {"mode": placement},
        # a learner-only GPU test: vLLM (not started) would refuse the fp32 fixture
        **({"rollout": {"backend": "hf"}} if placement != "cpu" else {}),
        "seed": 0,
        "model": {"path": str(tiny_dir / "model"), "dtype": dtype},
        "data": {"parquet": str(tiny_dir / "rl.parquet")},
        "injection": {"mode": mode},
        "learner": {"lora_r": 8, "lora_alpha": 16, "micro_batch": 4, "lr": 1e-3, "optimizer": "adamw", **learner},
    }
    return build_config(raw, "test")


def load_tiny_spec(tiny_dir):
    from nla_grpo.shared.spec import load_spec, sidecar_path

    return load_spec(sidecar_path(tiny_dir / "rl.parquet"))


def prompts_and_vectors(tiny_dir, n_prompts: int):
    """(prompt ids, marker site, activation) for the first ``n_prompts`` rows."""
    from transformers import AutoTokenizer

    from nla_grpo.shared.data import read_rows
    from nla_grpo.shared.prompts import find_marker_site, render_av_ids

    spec = load_tiny_spec(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir / "model")
    rows = read_rows(tiny_dir / "rl.parquet", spec.d_model, max_rows=n_prompts)
    out = []
    for i in range(n_prompts):
        ids = render_av_ids(tok, rows.prompts[i], spec.marker)
        out.append((ids, find_marker_site(ids, spec.marker_id, spec.left_id, spec.right_id),
                    torch.tensor(rows.activations[i])))
    return out


@torch.no_grad()
def sample_responses(tiny_dir, mode: str, n_prompts: int = 3, group: int = 2, max_new: int = 6, seed: int = 0):
    """GRPO-shaped synthetic rollouts: ``(samples, vectors[N, d])`` with ragged response lengths."""
    from transformers import AutoModelForCausalLM

    from nla_grpo.shared.injection import KarvonenHook, embed_batch, embed_norm

    cfg = make_cfg(tiny_dir, mode)
    spec = load_tiny_spec(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32).eval()
    emb = model.get_input_embeddings()
    scale = spec.injection_scale(cfg.injection.scale, embed_norm=embed_norm(emb.weight))
    hook = KarvonenHook(model, cfg.injection.karvonen_layer) if mode == "karvonen" else None
    gen = torch.Generator().manual_seed(seed)
    samples, vectors = [], []
    for row, (ids, site, vec) in enumerate(prompts_and_vectors(tiny_dir, n_prompts)):
        for g in range(group):
            length = 1 + (row + g) % max_new  # ragged lengths, every sample non-empty
            seq, logps = list(ids), []
            for _ in range(length):
                x = torch.tensor([seq])
                sites, v = torch.tensor([site]), vec.unsqueeze(0)
                if hook is not None:
                    hook.set(sites, v)
                    logits = model(input_ids=x).logits
                    hook.clear()
                else:
                    logits = model(inputs_embeds=embed_batch(x, emb, sites, v, scale)).logits
                logp = torch.log_softmax(logits[0, -1].float(), dim=-1)
                t = int(torch.multinomial(logp.exp(), 1, generator=gen))
                seq.append(t)
                logps.append(float(logp[t]))
            samples.append(Sample(row_id=row, group_index=g, prompt_ids=list(ids), site=site,
                                  response_ids=seq[len(ids):], logprobs=logps, text="", finish_reason="length",
                                  adapter_version=1))
            vectors.append(vec)
    if hook is not None:
        hook.remove()
    return samples, torch.stack(vectors)


def test_learner_logprobs_equal_the_independent_sampler(tiny_dir):
    from nla_grpo.learner.learner import Learner

    for mode in ("embed", "karvonen"):
        samples, vectors = sample_responses(tiny_dir, mode)
        learner = Learner(make_cfg(tiny_dir, mode, micro_batch=4), load_tiny_spec(tiny_dir))
        for adapter in ("default", "reference"):
            got = learner.logprobs(samples, vectors, adapter)
            for s, lp in zip(samples, got):
                assert len(lp) == len(s.response_ids)
                assert max(abs(a - b) for a, b in zip(lp, s.logprobs)) < 1e-5, mode

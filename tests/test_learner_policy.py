"""Batching and response-logprob indexing of the learner forward (pure tensors, no model)."""
import torch

from learner.policy import logits_to_keep, pad_batch, response_logprobs


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

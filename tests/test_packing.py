"""Shared-prefix packing, the chunked LM-head logprobs, the fused LoRA forward and the memory plan: pure pieces."""
import contextlib

import pytest
import torch

from nla_grpo.learner.memory_plan import QUANTUM, activation_bytes_per_token, token_budget
from nla_grpo.learner.packing import build_rows, pack, plan_micro_batches, segment_mask, unpack_tokens
from nla_grpo.learner.token_logprobs import token_logprobs


def _rows_input():
    prompts = [[5, 6, 7]] * 3 + [[8, 9]] * 2
    vec = [torch.ones(4)] * 3 + [torch.zeros(4)] * 2
    return prompts, [1] * 5, vec, [2, 1, 3, 4, 1]


def test_rows_group_samples_that_share_prompt_site_and_vector():
    prompts, sites, vecs, lens = _rows_input()
    rows = build_rows(prompts, sites, vecs, lens)
    assert [r.members for r in rows] == [(0, 1, 2), (3, 4)]
    assert [r.length for r in rows] == [3 + 6, 2 + 5]
    other = list(vecs)
    other[1] = torch.full((4,), 2.0)  # another activation: never the same row, even with the same prompt
    assert [r.members for r in build_rows(prompts, sites, other, lens)] == [(0, 2), (1,), (3, 4)]


def test_rows_split_beyond_the_budgets():
    prompts, sites, vecs, lens = _rows_input()
    assert [r.members for r in build_rows(prompts, sites, vecs, lens, max_samples=2)] == [(0, 1), (2,), (3, 4)]
    # 3 + 2 + 1 = 6 fits 6 tokens, + 3 more would not
    assert [r.members for r in build_rows(prompts, sites, vecs, lens, max_tokens=6)] == [(0, 1), (2,), (3,), (4,)]


def test_micro_batches_sort_longest_first_and_respect_both_limits():
    prompts, sites, vecs, lens = _rows_input()
    rows = build_rows(prompts, sites, vecs, lens, max_samples=1)
    assert [r.length for r in rows] == [5, 4, 6, 6, 3]
    batches = plan_micro_batches(rows, max_samples=2)
    assert [[r.members[0] for r in b] for b in batches] == [[2, 3], [0, 1], [4]]
    assert all(sum(len(r.members) for r in b) <= 2 for b in batches)
    # padded tokens = rows × the longest row rounded up to the alignment
    one_each = plan_micro_batches(rows, max_tokens=16)
    assert all(len(b) == 1 for b in one_each)
    assert len(plan_micro_batches(rows, max_tokens=32)) == 3


def test_segment_mask_keeps_responses_apart():
    # prompt 0-1, response a 2-3, response b 4, pad 5
    seg = torch.tensor([[-1, -1, 0, 0, 1, -2]])
    m = segment_mask(seg)[0, 0]
    assert m.shape == (6, 6)
    assert m[1].tolist() == [True, True, False, False, False, False]
    assert m[3].tolist() == [True, True, True, True, False, False]
    assert m[4].tolist() == [True, True, False, False, True, False]  # b sees the prompt and itself, never a
    assert m[5].tolist() == [False] * 5 + [True]  # pad: itself only (never a fully masked row)


def test_pack_places_positions_targets_and_predicting_positions():
    prompts, sites, vecs, _ = _rows_input()
    responses = [[11, 12], [13], [14, 15, 16], [17, 18, 19, 20], [21]]
    rows = build_rows(prompts, sites, vecs, [len(r) for r in responses])
    b = pack(rows, responses, pad_id=0, device="cpu")
    L = b.input_ids.shape[1]
    assert L % 16 == 0 and b.members == [0, 1, 2, 3, 4]
    assert b.input_ids[0, :9].tolist() == [5, 6, 7, 11, 12, 13, 14, 15, 16]
    assert b.position_ids[0, :9].tolist() == [0, 1, 2, 3, 4, 3, 3, 4, 5]  # every response restarts after the prompt
    assert b.targets.tolist() == [t for r in responses for t in r]
    # response 2's first token is predicted by the prompt's last position, the next ones by their predecessor
    flat = b.input_ids.reshape(-1)
    pred = b.pred_index.tolist()
    assert pred[3] == 2 and [flat[p].item() for p in pred[4:6]] == [14, 15]
    assert b.tokens == 3 * 3 + 6 + 2 * 2 + 5 and b.processed == 9 + 7
    values, mask = unpack_tokens(torch.arange(len(pred), dtype=torch.float32), b)
    assert values.shape == (5, 4) and mask.sum(1).tolist() == [2, 1, 3, 4, 1]
    assert values[3].tolist() == [6.0, 7.0, 8.0, 9.0] and values[1].tolist() == [2.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_token_logprobs_equal_log_softmax_in_value_and_gradient(chunk):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(7, 16, generator=gen, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(50, 16, generator=gen)
    t = torch.randint(0, 50, (7,), generator=gen)
    g = torch.randn(7, generator=gen)
    got = token_logprobs(h, w, t, chunk)
    (got * g).sum().backward()
    grad_got = h.grad.clone()
    h.grad = None
    want = torch.log_softmax(h @ w.t(), -1).gather(1, t[:, None]).squeeze(1)
    (want * g).sum().backward()
    assert torch.allclose(got, want, atol=1e-6) and torch.allclose(grad_got, h.grad, atol=1e-6)


def test_token_logprobs_round_logits_like_the_plain_head_in_bf16():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(5, 32, generator=gen).bfloat16()
    w = torch.randn(64, 32, generator=gen).bfloat16()
    t = torch.randint(0, 64, (5,), generator=gen)
    plain = torch.log_softmax(torch.nn.functional.linear(h, w).float(), -1).gather(1, t[:, None]).squeeze(1)
    assert torch.allclose(token_logprobs(h, w, t, 2), plain, atol=1e-5)


def test_token_logprobs_refuse_a_trainable_head_and_bad_shapes():
    h = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(6, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="frozen"):
        token_logprobs(h, w, torch.tensor([0, 1, 2])).sum().backward()
    with pytest.raises(ValueError, match="expected hidden"):
        token_logprobs(h, w, torch.tensor([0, 1]))


def _lora_pair(dtype):
    from peft import LoraConfig, get_peft_model

    from nla_grpo.learner import lora_compute

    def make():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8)).to(dtype)
        model = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], lora_dropout=0.0))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5)
        return model

    plain, fused = make(), make()
    assert lora_compute.install(fused) == 2
    return plain, fused


def test_fused_lora_forward_equals_peft_in_fp32():
    plain, fused = _lora_pair(torch.float32)
    x = torch.randn(3, 5, 16)
    a, b = plain(x), fused(x)
    assert torch.allclose(a, b, atol=1e-6)
    a.square().sum().backward()
    b.square().sum().backward()
    for (n, p), (_, q) in zip(plain.named_parameters(), fused.named_parameters()):
        if p.requires_grad:
            assert torch.allclose(p.grad, q.grad, atol=1e-5), n


@pytest.mark.parametrize("bias", [True, False])
def test_a_dense_base_accumulates_onto_the_lora_term_in_place(monkeypatch, bias):
    """The dense path (the base GEMM adding itself onto the LoRA term) against the earlier order, fp32."""
    from peft import LoraConfig, get_peft_model
    from torch.utils._python_dispatch import TorchDispatchMode

    from nla_grpo.learner import lora_compute

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    def run(accumulate):
        monkeypatch.setattr(lora_compute, "ACCUMULATE_IN_BASE", accumulate)
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 24, bias=bias))
        model = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, target_modules=["0"], lora_dropout=0.0))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5)
        lora_compute.install(model)
        x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with Ops() as ops:
            y = model(x)
        (y.sin() * 3).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        return y.detach(), x.grad, grads, ops.names

    y0, gx0, g0, ops0 = run(False)
    y1, gx1, g1, ops1 = run(True)
    assert "aten.addmm_" in ops1 and "aten.addmm_" not in ops0  # the base GEMM accumulated in place
    assert y1.shape == y0.shape and torch.allclose(y1, y0, atol=1e-6) and torch.allclose(gx1, gx0, atol=1e-6)
    assert g0.keys() == g1.keys() and all(torch.allclose(g1[k], g0[k], atol=1e-5) for k in g0)
    assert all(g1[k].abs().max() > 0 for k in g1)


def test_fused_lora_computes_in_bf16_and_keeps_fp32_weights_and_gradients():
    plain, fused = _lora_pair(torch.bfloat16)
    lora = [p for n, p in fused.named_parameters() if "lora_" in n]
    assert lora and all(p.dtype == torch.float32 for p in lora)  # PEFT's fp32 master weights
    x = torch.randn(4, 16).bfloat16()
    y = fused(x)
    assert y.dtype == torch.bfloat16
    assert (y.float() - plain(x).float()).abs().max() < 0.05  # the same function, rounded in bf16
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in lora)


class _Ops:
    """Counts the aten ops dispatched inside it."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                outer.n += 1
                return func(*args, **(kwargs or {}))

        self.n, self.mode = 0, Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def test_reused_casts_give_every_micro_batch_the_same_gradients_with_fewer_ops():
    """bf16 activations over fp32 adapter weights: two micro-batches' backward through the casts made once add up
    to the gradients of casts made per forward; an optimiser step (an in-place change) makes new casts; a cast
    made without gradients never serves a forward with them."""
    from nla_grpo.learner import lora_compute

    def run(reuse):
        _, fused = _lora_pair(torch.bfloat16)
        lora = {n: p for n, p in fused.named_parameters() if "lora_" in n}
        xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(k)).bfloat16() for k in range(3)]
        ops, outs = [], []
        with lora_compute.reusing_casts() if reuse else contextlib.nullcontext():
            with torch.no_grad():
                outs.append(fused(xs[2]))  # scoring first: its casts must not be taken below
            for x in xs[:2]:
                with _Ops() as count:
                    y = fused(x)
                ops.append(count.n)
                (y.float() ** 2).sum().backward()
            grads = {n: p.grad.clone() for n, p in lora.items()}
            with torch.no_grad():
                for p in lora.values():
                    p.add_(0.25)  # what an optimiser step does: in place
            outs.append(fused(xs[0]).detach())
        return grads, ops, outs

    want, ops_plain, outs_plain = run(False)
    got, ops_reused, outs_reused = run(True)
    assert want.keys() == got.keys() and all(want[k].abs().max() > 0 for k in want)
    assert all(torch.equal(got[k], want[k]) for k in want)  # the same arithmetic, to the bit
    assert all(torch.equal(a, b) for a, b in zip(outs_reused, outs_plain))  # the step's new weights are used
    assert ops_reused[1] < ops_plain[1] and ops_reused[1] < ops_reused[0]  # the second micro-batch casts nothing


def test_memory_plan():
    # the 8B shape, bf16, no checkpointing: about 6.8 MB per token
    per = activation_bytes_per_token(4096, 12288, 36, 32, 8, 128, 128, 2, False)
    assert 6e6 < per < 7.5e6
    assert activation_bytes_per_token(4096, 12288, 36, 32, 8, 128, 128, 2, True) < per / 10
    # fused kernels (liger, compile): no fp32 norm intermediates, no SiLU output kept
    fused = activation_bytes_per_token(4096, 12288, 36, 32, 8, 128, 128, 2, False, fused=True)
    assert fused == 36 * 2 * (4 * 4096 + 4 * 4096 + 3 * 1024 + 3 * 12288 + 7 * 128) and 0.7 * per < fused < 0.8 * per
    # varlen attention keeps the gathered keys and values: a prompt's once per segment reading them
    gathered = activation_bytes_per_token(4096, 12288, 36, 32, 8, 128, 128, 2, False, fused=True, gathered_kv=True)
    assert gathered - fused == 36 * 2 * 2 * 1024
    budget = token_budget(60 * 2**30, per, reserve_bytes=4 * 2**30)
    assert budget % QUANTUM == 0 and budget * 1.5 * per <= 0.9 * 56 * 2**30
    assert token_budget(60 * 2**30 + 2**20, per, 4 * 2**30) == budget  # a little jitter changes nothing
    assert token_budget(0, per) == 512


def test_the_measured_kernels_plan_with_the_smaller_margin():
    from nla_grpo.learner.memory_plan import SAFETY, SAFETY_MEASURED, safety

    assert safety(True, "varlen") == safety(True, "flex") == SAFETY_MEASURED < SAFETY
    # an eager layer, or SDPA's dense mask, kept more than the count on the H200: the wide margin stays
    assert safety(False, "varlen") == safety(True, "sdpa") == safety(False, "sdpa") == SAFETY
    per = activation_bytes_per_token(4096, 12288, 36, 32, 8, 128, 128, 2, False, fused=True, gathered_kv=True)
    wide, narrow = (token_budget(80 * 2**30, per, 0, f) for f in (SAFETY, SAFETY_MEASURED))
    assert narrow > wide and narrow * SAFETY_MEASURED * per <= 0.9 * 80 * 2**30


def test_auto_attention_takes_the_varlen_kernel_on_a_gpu_in_16_bits(monkeypatch):
    from nla_grpo.learner import packed_attention, varlen_attention

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(varlen_attention, "available", lambda: True)
    assert packed_attention.resolve("auto", cuda, True, torch.bfloat16) == "varlen"
    assert packed_attention.resolve("auto", cuda, True, torch.float16) == "varlen"
    assert packed_attention.resolve("auto", cuda, True, torch.float32) == "flex"  # fp32 (nf4_fp32_modules): no kernel
    assert packed_attention.resolve("auto", cpu, True, torch.bfloat16) == "sdpa"
    assert packed_attention.resolve("auto", cuda, False, torch.bfloat16) == "sdpa"  # the padded forward
    monkeypatch.setattr(varlen_attention, "available", lambda: False)  # a torch without the kernel
    assert packed_attention.resolve("auto", cuda, True, torch.bfloat16) == "flex"


def test_right_pad_is_the_one_padding_builder():
    from nla_grpo.shared.torch_utils import right_pad

    ids, mask = right_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_rows_never_exceed_the_row_cap():
    from nla_grpo.learner.packing import MAX_ROW_TOKENS

    n = 40
    rows = build_rows([[1, 2]] * n, [1] * n, [torch.zeros(2)] * n, [500] * n)
    assert len(rows) > 1 and all(r.length <= MAX_ROW_TOKENS for r in rows)
    assert sorted(i for r in rows for i in r.members) == list(range(n))


def test_fused_lora_leaves_a_lora_bias_to_peft():
    from peft import LoraConfig, get_peft_model

    from nla_grpo.learner import lora_compute

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8))
    model = get_peft_model(net, LoraConfig(r=2, lora_alpha=4, target_modules=["0"], lora_bias=True))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    x = torch.randn(3, 8)
    want = model(x)
    lora_compute.install(model)
    assert torch.allclose(model(x), want, atol=1e-6)

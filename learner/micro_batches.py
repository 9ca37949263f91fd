"""A step's micro-batches: the validated items a batch of samples becomes, the token budget under
``learner.micro_batch: auto`` (chosen at the first forward from the free memory, then kept, and saved in
checkpoints so a resumed run cuts the same micro-batches), and the plan: packed rows (``learner.packing``:
a group's prompt once, its responses after it) or padded chunks, dealt over the data-parallel ranks so N
ranks run exactly the micro-batches one would.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

QUANTUM_TOKENS = 512  # the smallest per-rank token budget under micro_batch auto


@dataclass
class Item:
    """One non-empty sample, ready to batch."""

    index: int
    prompt_ids: list[int]
    response_ids: list[int]
    site: int
    vector: torch.Tensor
    rollout_logp: torch.Tensor
    advantage: float


def _as_matrix(vectors, n: int) -> torch.Tensor:
    if isinstance(vectors, (list, tuple)) and vectors and isinstance(vectors[0], torch.Tensor):
        m = torch.stack([v.reshape(-1) for v in vectors])
    else:
        m = torch.as_tensor(vectors)
    m = m.detach().to("cpu", torch.float32)
    if m.ndim != 2 or m.shape[0] != n:
        raise ValueError(f"vectors: expected [{n}, d] (one activation per sample), found {tuple(m.shape)}")
    return m


def items_from(samples, vectors, advantages=None) -> list[Item]:
    """Validated non-empty samples (empty responses carry no token to learn from and are dropped)."""
    vecs = _as_matrix(vectors, len(samples))
    if advantages is not None and len(advantages) != len(samples):
        raise ValueError(f"advantages: expected {len(samples)} values (one per sample), found {len(advantages)}")
    items = []
    for i, s in enumerate(samples):
        if not s.response_ids:
            continue
        if len(s.logprobs) != len(s.response_ids):
            raise ValueError(f"sample {i} (row {s.row_id}): {len(s.response_ids)} response ids but {len(s.logprobs)} logprobs")
        if not 0 < s.site < len(s.prompt_ids) - 1:
            raise ValueError(f"sample {i} (row {s.row_id}): marker site {s.site} outside the prompt's interior")
        adv = 0.0 if advantages is None else float(advantages[i])
        items.append(Item(i, list(s.prompt_ids), list(s.response_ids), int(s.site), vecs[i],
                          torch.tensor(s.logprobs, dtype=torch.float32), adv))
    return items


class MicroBatches:
    """The micro-batches of the learner's policy on this rank: ``self(items, params, optimizer)`` yields
    ``(idx, batch)``, ``idx[s]`` being the item that sample ``s`` of ``batch`` scores."""

    def __init__(self, cfg, policy, dp, device):
        self.cfg, self.policy, self.dp, self.device = cfg, policy, dp, device
        self.budget: int | None = None  # micro_batch auto: chosen at the first forward, then kept

    def token_budget(self, params, optimizer) -> int | None:
        """Tokens per micro-batch under ``micro_batch: auto`` (chosen once, then kept; None otherwise)."""
        if self.cfg.learner.micro_batch != "auto":
            return None
        if self.budget is None:
            self.budget = self.plan_budget(params, optimizer)
        return self.budget

    def plan_budget(self, params, optimizer) -> int:
        """The budget ``micro_batch: auto`` would choose with the memory free now (every data-parallel rank calls
        it together); ``token_budget`` keeps the first one."""
        from nla_grpo.learner import kernels
        from nla_grpo.learner.memory_plan import plan_tokens, transient_bytes

        model = self.policy.model
        elem = model.get_input_embeddings().weight.element_size()
        # gradients and both Adam moments of the fp32 adapter appear at the first step
        reserve = 0 if optimizer.state else 3 * sum(p.numel() * p.element_size() for p in params)
        # the adapter casts and the LM head's fp32 logit chunks, held through the update besides the activations
        reserve += transient_bytes(sum(p.numel() for p in params), elem)
        # ... and, on several ranks, the float64 gradient sums (two more copies of the adapter)
        if self.dp.world_size > 1:
            reserve += 2 * sum(p.numel() * p.element_size() for p in params)
        budget = plan_tokens(model.get_base_model().config, self.cfg.learner.lora_r, elem,
                             self.cfg.learner.gradient_checkpointing, self.device, reserve,
                             fused=self.policy.kernels in kernels.FUSED,
                             attention=self.policy.attention)
        # data-parallel ranks plan the same micro-batches: the budget every rank's memory allows
        return int(self.dp.min_value(budget, self.device))

    def plan(self, items: list[Item], budget: int | None) -> list:
        """The micro-batches one rank would run on ``items``, as ``(tokens, build)`` pairs: ``build()``
        gives ``(idx, batch)``."""
        mb = self.cfg.learner.micro_batch
        if self.policy.packed:
            from nla_grpo.learner.packing import build_rows, pack, plan_micro_batches

            # an integer micro_batch bounds a row by what that many padded samples would hold, so a large
            # group never needs more memory than the padded path did; auto bounds it by the budget
            max_samples = None if mb == "auto" else mb
            if budget is None:
                budget = mb * max((len(it.prompt_ids) + len(it.response_ids) for it in items), default=1)
            elif self.dp.world_size > 1:  # auto: enough micro-batches for every rank to have work
                total = sum(len(it.prompt_ids) + len(it.response_ids) for it in items)
                budget = max(QUANTUM_TOKENS, min(budget, -(-total // self.dp.world_size)))
            rows = build_rows([it.prompt_ids for it in items], [it.site for it in items], [it.vector for it in items],
                              [len(it.response_ids) for it in items], None, budget)
            responses = [it.response_ids for it in items]

            def packed(group):
                def build():
                    batch = pack(group, responses, self.policy.pad_id, self.device,
                                 dense_mask=self.policy.attention == "sdpa", varlen=self.policy.attention == "varlen")
                    return batch.members, batch
                return sum(r.length for r in group), build

            return [packed(group) for group in plan_micro_batches(rows, max_samples, budget)]
        if mb == "auto":
            mb = max(1, budget // max(len(it.prompt_ids) + len(it.response_ids) for it in items))
            if self.dp.world_size > 1:
                mb = max(1, min(mb, -(-len(items) // self.dp.world_size)))

        def padded(start):
            chunk = items[start: start + mb]

            def build():
                batch = self.policy.batch([it.prompt_ids for it in chunk], [it.response_ids for it in chunk],
                                          [it.site for it in chunk], torch.stack([it.vector for it in chunk]))
                return list(range(start, start + len(chunk))), batch
            return sum(len(it.prompt_ids) + len(it.response_ids) for it in chunk), build

        return [padded(start) for start in range(0, len(items), mb)]

    def __call__(self, items: list[Item], params, optimizer, mine: bool = True):
        """``(idx, batch)`` per micro-batch of the plan: with ``mine``, only this rank's share of it
        (``shared.collective.deal_micro_batches``), so N ranks run exactly the micro-batches one would."""
        if not items:
            return
        plan = self.plan(items, self.token_budget(params, optimizer))
        for j in (self.dp.share([tokens for tokens, _ in plan]) if mine else range(len(plan))):
            yield plan[j][1]()

"""Shared-prefix packing: the samples of one GRPO group share their prompt, so the learner runs that
prompt once and lays the group's responses after it in the same row.

A row is ``[prompt | response_1 | response_2 | ... | pad]``. Each response attends to the whole
prompt and causally to itself, never to another response; positions restart after the prompt, so
every response sees exactly the sequence it was sampled from. The forward then costs
``P + Σ lᵢ`` tokens per group instead of ``Σ (P + lᵢ)`` and carries no padding inside a row (rows
of one micro-batch are padded to the longest, and rows are sorted by length so that is little).

Everything here is plain index arithmetic on the CPU (pure functions, unit-tested); the forward
that consumes a ``PackedBatch`` lives in ``learner.policy``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nla_grpo.learner.varlen_attention import layout as varlen_layout

# rows are padded to a multiple of this: the memory-efficient attention kernel wants aligned masks
ALIGN = 16
# a row is split beyond this many tokens: its mask is L x L (8192 tokens: 67 MB as bool, twice that in bf16)
MAX_ROW_TOKENS = 8192


@dataclass(frozen=True)
class Row:
    """One packed row: a shared prompt (ids, marker site, activation) and the items whose responses follow it."""

    prompt_ids: tuple[int, ...]
    site: int
    vector: torch.Tensor
    members: tuple[int, ...]  # indices into the caller's item list
    response_lens: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + sum(self.response_lens)


@dataclass
class PackedBatch:
    """Tensors of one packed micro-batch; ``members[s]`` is the caller's index of local sample ``s``."""

    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L]
    attention_mask: torch.Tensor | None  # [R, 1, L, L] bool, True = may attend (None: flex attention, from segments)
    segments: torch.Tensor  # [R, L] -1 prompt, k >= 0 response k, -2 pad
    sites: torch.Tensor  # [R]
    vectors: torch.Tensor  # [R, d] fp32
    pred_index: torch.Tensor  # [M] flat index (r·L + p) of the position that predicts each response token
    targets: torch.Tensor  # [M] the response tokens
    slot: torch.Tensor  # [M] flat index (s·T + t) of each token in the [S, T] result
    response_lens: torch.Tensor  # [S]
    members: list[int]
    tokens: int  # logical tokens (Σ prompt + response over samples), what an unpacked forward would process
    processed: int  # tokens actually in the rows (without padding)
    varlen: object = None  # learner.varlen_attention.VarlenLayout (learner.attention varlen), on the device


def _key(prompt_ids, site, vector: torch.Tensor):
    return tuple(prompt_ids), int(site), vector.numpy().tobytes()


def build_rows(prompts, sites, vectors, response_lens, max_samples: int | None = None,
               max_tokens: int | None = None) -> list[Row]:
    """Group samples that share prompt, site and activation into rows, in first-seen order.

    A group is split into several rows (each repeating the prompt) so that no row holds more than
    ``max_samples`` responses or, beyond its first response, more than ``max_tokens`` (and
    ``MAX_ROW_TOKENS``) tokens.
    """
    max_tokens = min(max_tokens or MAX_ROW_TOKENS, MAX_ROW_TOKENS)
    groups: dict = {}
    for i, (p, s, v) in enumerate(zip(prompts, sites, vectors)):
        groups.setdefault(_key(p, s, v), []).append(i)
    rows = []
    for (p, s, _), idx in groups.items():
        current: list[int] = []
        for i in idx:
            longer = len(p) + sum(response_lens[j] for j in current) + response_lens[i]
            if current and ((max_samples and len(current) >= max_samples) or (max_tokens and longer > max_tokens)):
                rows.append(Row(p, s, vectors[idx[0]], tuple(current), tuple(response_lens[j] for j in current)))
                current = []
            current.append(i)
        rows.append(Row(p, s, vectors[idx[0]], tuple(current), tuple(response_lens[j] for j in current)))
    return rows


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_micro_batches(rows: list[Row], max_samples: int | None = None, max_tokens: int | None = None) -> list[list[Row]]:
    """Rows sorted longest first, then filled greedily into micro-batches of at most ``max_samples``
    samples and ``max_tokens`` padded tokens (rows × the longest row). A row is never split here."""
    ordered = sorted(rows, key=lambda r: (-r.length, r.members[0]))
    batches: list[list[Row]] = []
    for row in ordered:
        if batches:
            last = batches[-1]
            samples = sum(len(r.members) for r in last) + len(row.members)
            padded = (len(last) + 1) * _aligned(last[0].length)  # last[0] is the longest (sorted)
            if (not max_samples or samples <= max_samples) and (not max_tokens or padded <= max_tokens):
                last.append(row)
                continue
        batches.append([row])
    return batches


def segment_mask(segments: torch.Tensor) -> torch.Tensor:
    """``[R, 1, L, L]`` bool from per-position segment ids (-1 prompt, k >= 0 response k, -2 pad).

    A query attends to earlier-or-equal keys of the prompt and of its own segment; a pad position
    attends only to itself (a fully masked row would give NaN in attention, and NaN poisons backward).
    """
    L = segments.shape[1]
    q = segments.unsqueeze(2)  # [R, L, 1]
    k = segments.unsqueeze(1)  # [R, 1, L]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    allowed = causal & (k != -2) & ((k == -1) | (k == q)) & (q != -2)
    allowed |= torch.eye(L, dtype=torch.bool) & (q == -2)
    return allowed.unsqueeze(1)


def pack(rows: list[Row], responses: list[list[int]], pad_id: int, device, dense_mask: bool = True,
         varlen: bool = False) -> PackedBatch:
    """The tensors of one micro-batch of ``rows``; ``responses[i]`` is item i's response ids. ``dense_mask``:
    build the ``[R, 1, L, L]`` mask (not needed by ``learner.packed_attention``, which reads the segments);
    ``varlen``: build the rows' variable-length segments (``learner.varlen_attention``), here on the host."""
    R = len(rows)
    L = _aligned(max(r.length for r in rows))
    ids = torch.full((R, L), pad_id, dtype=torch.long)
    pos = torch.zeros((R, L), dtype=torch.long)
    seg = torch.full((R, L), -2, dtype=torch.long)
    pred, targets, members, lens = [], [], [], []
    for r, row in enumerate(rows):
        P = len(row.prompt_ids)
        ids[r, :P] = torch.tensor(row.prompt_ids)
        pos[r, :P] = torch.arange(P)
        seg[r, :P] = -1
        start = P
        for k, i in enumerate(row.members):
            resp = responses[i]
            n = len(resp)
            ids[r, start: start + n] = torch.tensor(resp)
            pos[r, start: start + n] = torch.arange(P, P + n)
            seg[r, start: start + n] = len(members)
            # token 0 is predicted by the prompt's last position, token t > 0 by the token before it
            pred.append(torch.cat([torch.tensor([r * L + P - 1]), r * L + torch.arange(start, start + n - 1)]))
            targets.append(torch.tensor(resp))
            members.append(i)
            lens.append(n)
            start += n
    T = max(lens)
    slot = torch.cat([s * T + torch.arange(n) for s, n in enumerate(lens)])
    # host work before the first copy to the GPU: that copy waits for the GPU's queue to drain (the micro-batch before)
    layout = varlen_layout(seg) if varlen else None
    mask = segment_mask(seg) if dense_mask else None
    return PackedBatch(
        input_ids=ids.to(device), position_ids=pos.to(device),
        attention_mask=mask.to(device) if mask is not None else None, segments=seg.to(device),
        sites=torch.tensor([row.site for row in rows], dtype=torch.long, device=device),
        vectors=torch.stack([row.vector for row in rows]).to(device=device, dtype=torch.float32),
        pred_index=torch.cat(pred).to(device), targets=torch.cat(targets).to(device), slot=slot.to(device),
        response_lens=torch.tensor(lens, dtype=torch.long, device=device), members=members,
        tokens=sum(len(row.prompt_ids) * len(row.members) + sum(row.response_lens) for row in rows),
        processed=sum(row.length for row in rows),
        varlen=layout.to(device) if layout is not None else None,
    )



def unpack_tokens(values: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat per-token ``values[M]`` -> ``([S, T] with zeros beyond each length, mask[S, T])``; keeps autograd."""
    S, T = batch.response_lens.numel(), int(batch.response_lens.max())
    out = torch.zeros(S * T, dtype=values.dtype, device=values.device).index_copy(0, batch.slot, values)
    mask = torch.arange(T, device=values.device).unsqueeze(0) < batch.response_lens.unsqueeze(1)
    return out.view(S, T), mask

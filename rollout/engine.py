"""The rollout interface both backends implement, and the per-sample bookkeeping they share.

A backend turns ``PromptRequest``s into ``Sample``s: ``group_size`` samples per request, ordered
request by request, then group index 0..G-1. What a sample means (stop set, trimming, finish
reason, marker echo, text) is decided here once, so the vLLM and HF backends cannot disagree.
"""
from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from pathlib import Path

from nla_grpo.shared.errors import NlaInputError
from nla_grpo.shared.prompts import has_marker_trigram
from nla_grpo.shared.types import AdapterUpdate, PromptRequest, Sample

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


class RolloutEngine(ABC):
    """Generates GRPO groups under the current policy adapter (version 0 = the bare base model)."""

    @abstractmethod
    def generate(self, requests: list[PromptRequest], seed: int, ignore_eos: bool = False, inject: bool = True) -> list[Sample]:
        """``group_size`` samples per request; a fixed ``seed`` gives the same samples.

        ``ignore_eos`` samples straight through stop ids up to the token cap (benchmarks);
        ``inject=False`` leaves the marker's own embedding in place (diagnostics, parity checks).
        """

    @abstractmethod
    def load_adapter(self, update: AdapterUpdate) -> None:
        """Make ``update`` the adapter of every later ``generate`` (a new name and id per version)."""

    @property
    @abstractmethod
    def adapter_version(self) -> int:
        """Version of the adapter in use; 0 = no adapter."""

    def describe(self) -> str:
        """One line on what this engine runs (the start's log)."""
        return type(self).__name__

    def sleep(self) -> None:
        """Give the GPU memory back while the learner updates (engines that cannot: an error)."""
        raise NotImplementedError(f"{type(self).__name__} cannot sleep")

    def wake_up(self) -> None:
        """Undo ``sleep``: weights back in place, KV cache re-allocated."""
        raise NotImplementedError(f"{type(self).__name__} cannot sleep")

    def close(self) -> None:
        """Release the engine's resources (idempotent)."""


def model_dir(cfg) -> Path:
    """The subject model directory from the run config."""
    return Path(cfg.model.path)


def stop_token_ids(model_path, tokenizer, extra_stop_tokens: list[str]) -> list[int]:
    """Every EOS id of the model's generation config, then each extra stop string's single id.

    Falls back to the tokenizer's EOS id when the model has no generation config.
    """
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = [int(e) for e in ([] if eos is None else eos if isinstance(eos, (list, tuple)) else [eos])]
    for text in extra_stop_tokens:
        enc = tokenizer.encode(text, add_special_tokens=False)
        enc = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
        if len(enc) != 1:
            raise NlaInputError("rollout.extra_stop_tokens", f"{text!r}: expected to encode to one token id, found {enc}")
        ids.append(int(enc[0]))
    if not ids:
        raise NlaInputError(model_path, "no EOS id in generation_config.json or the tokenizer, and no rollout.extra_stop_tokens")
    return list(dict.fromkeys(ids))


def trim_at_stop(response_ids, logprobs, stop_ids, max_new_tokens: int) -> tuple[list[int], list[float], str]:
    """Cut after the first stop id (inclusive) and name the finish reason.

    ``stop`` when a stop id ends the response; ``length`` when the cap was reached without one.
    Anything after the first stop id (HF pads finished rows of a batch) was never sampled.
    """
    ids = [int(t) for t in response_ids]
    lps = [float(x) for x in logprobs]
    if len(lps) != len(ids):
        raise ValueError(f"{len(ids)} response tokens but {len(lps)} logprobs")
    stops = set(stop_ids)
    cut = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
    if cut is not None:
        return ids[:cut], lps[:cut], FINISH_STOP
    if len(ids) > max_new_tokens:
        raise ValueError(f"{len(ids)} response tokens exceed the cap {max_new_tokens}")
    return ids, lps, FINISH_LENGTH


def sample_seed(seed: int, row_id: int) -> int:
    """Per-request sampling seed from (run seed, row id): stable across processes and backends."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(row_id)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


def request_vector(req: PromptRequest, d_model: int):
    """The request's activation as a 1-D fp32 tensor of length d_model."""
    import numpy as np
    import torch

    v = req.vector
    v = v.detach().float().cpu() if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v, dtype=np.float32))
    if v.ndim != 1 or v.shape[0] != d_model:
        raise NlaInputError(f"row {req.row_id}", f"activation vector: expected shape ({d_model},), found {tuple(v.shape)}")
    if not bool(torch.isfinite(v).all()):
        raise NlaInputError(f"row {req.row_id}", "activation vector: expected finite values")
    return v


def check_request(req: PromptRequest, spec) -> None:
    """The site must point at the marker inside the prompt (a wrong site injects into a random token)."""
    ids = req.prompt_ids
    if not (0 < req.site < len(ids) - 1) or int(ids[req.site]) != spec.marker_id:
        raise NlaInputError(f"row {req.row_id}", f"site {req.site}: expected the marker id {spec.marker_id} inside the prompt")


class SampleBuilder:
    """Turns one raw response (ids + sampled-token logprobs) into a ``Sample``."""

    def __init__(self, tokenizer, spec, stop_ids: list[int], prefill: str, max_new_tokens: int):
        self.tokenizer = tokenizer
        self.spec = spec
        self.stop_ids = list(stop_ids)
        self.prefill = prefill
        self.max_new_tokens = max_new_tokens

    def build(self, req: PromptRequest, group_index: int, response_ids, logprobs, adapter_version: int, trim: bool = True) -> Sample:
        if trim:
            ids, lps, finish = trim_at_stop(response_ids, logprobs, self.stop_ids, self.max_new_tokens)
        else:  # ignore_eos: every token up to the cap was sampled on purpose
            ids, lps, finish = [int(t) for t in response_ids], [float(x) for x in logprobs], FINISH_LENGTH
        # two prompt tokens in front catch a trigram completed across the prompt/response boundary
        context = [int(t) for t in req.prompt_ids[-2:]] + ids
        echo = has_marker_trigram(context, self.spec.marker_id, self.spec.left_id, self.spec.right_id)
        return Sample(
            row_id=req.row_id, group_index=group_index, prompt_ids=[int(t) for t in req.prompt_ids], site=int(req.site),
            response_ids=ids, logprobs=lps, text=self.prefill + self.tokenizer.decode(ids, skip_special_tokens=True),
            finish_reason=finish, adapter_version=adapter_version, marker_echo=echo,
        )

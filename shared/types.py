"""Records that cross service boundaries (plain data: they travel through Ray's object store)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PromptRequest:
    """One prompt to roll out: its token ids, the marker position and the activation to inject."""

    row_id: int
    prompt_ids: list[int]
    site: int
    vector: list[float] | object  # list of floats or a 1-D float tensor / array of length d


@dataclass
class Sample:
    """One sampled response, with everything the learner and the logs need."""

    row_id: int
    group_index: int
    prompt_ids: list[int]
    site: int
    response_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" or "length"
    adapter_version: int
    marker_echo: bool = False


@dataclass
class AdapterUpdate:
    """The policy adapter as tensors (name -> CPU tensor, PEFT key names) + its PEFT config and version."""

    version: int
    tensors: dict = field(default_factory=dict)
    peft_config: dict = field(default_factory=dict)

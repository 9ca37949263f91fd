"""Rollouts for the driver: launched on the engines round-robin, gathered in request order.

With ``grpo.overlap_rollout`` the driver launches step k+1's rollout right after step k's rewards,
so the engines generate it (with adapter v_k, one step behind) while the learner updates. The batch
of a launched rollout is drawn from the data order at launch; a checkpoint taken while one is in
flight stores its finished samples, so a resumed run uses exactly those samples again.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from nla_grpo.orchestrator.checkpoint import PENDING_FILE
from nla_grpo.shared.fileio import write_json



@dataclass
class Launched:
    step: int
    idx: list  # training-row indices of the batch
    version: int  # adapter version the engines held at launch
    refs: list | None  # one Ray object reference per engine (None once gathered)
    counts: list  # requests sent to each engine
    samples: list | None = None


def step_seed(seed: int, step: int) -> int:
    return seed * 7919 + step


def launch(engines, requests, seed: int) -> tuple[list, list]:
    """Start ``generate`` on every engine (request k goes to engine k mod n); returns refs and counts."""
    n = len(engines)
    parts = [requests[k::n] for k in range(n)]
    return [eng.generate.remote(p, seed) for eng, p in zip(engines, parts) if p], [len(p) for p in parts if p]


def gather(refs, counts) -> list:
    """The samples of ``launch``, in request order (each request's group together)."""
    import ray

    parts = ray.get(refs)
    n = len(parts)
    g = len(parts[0]) // max(1, counts[0])
    ordered = [None] * sum(counts)
    for k, samples in enumerate(parts):
        for j in range(counts[k]):
            ordered[k + j * n] = samples[j * g : (j + 1) * g]
    return [s for group in ordered for s in group]


def rollout(engines, requests, seed: int) -> list:
    return gather(*launch(engines, requests, seed))


class RolloutFeed:
    """Holds at most one launched rollout; the driver launches, then collects it at its step."""

    def __init__(self, engines, make_requests, order, batch_size: int, seed: int):
        self.engines, self.make_requests, self.order = engines, make_requests, order
        self.batch_size, self.seed = batch_size, seed
        self.pending: Launched | None = None

    def launch(self, step: int, version: int) -> None:
        if self.pending is not None:
            raise RuntimeError(f"a rollout for step {self.pending.step} is still in flight")
        idx = [int(i) for i in self.order.next_batch(self.batch_size)]
        refs, counts = launch(self.engines, self.make_requests(idx), step_seed(self.seed, step))
        self.pending = Launched(step, idx, version, refs, counts)

    def wait(self) -> None:
        """Block until the launched rollout is done and fetch it (a failed rollout raises here)."""
        if self.pending is not None and self.pending.samples is None:
            self.pending.samples, self.pending.refs = gather(self.pending.refs, self.pending.counts), None

    def collect(self, step: int) -> Launched:
        """The rollout launched for ``step``, with its samples."""
        if self.pending is None or self.pending.step != step:
            raise RuntimeError(f"no rollout was launched for step {step}")
        self.wait()
        got, self.pending = self.pending, None
        return got

    # ---- checkpointing ----
    def save(self, directory: Path) -> None:
        """Write the in-flight rollout (waiting for it) so a resume uses the very same samples."""
        if self.pending is None:
            return
        self.wait()
        p = self.pending
        record = {"step": p.step, "idx": p.idx, "version": p.version, "samples": [asdict(s) for s in p.samples]}
        write_json(Path(directory) / PENDING_FILE, record, indent=None)

    def restore(self, directory: Path) -> None:
        from nla_grpo.shared.types import Sample

        path = Path(directory) / PENDING_FILE
        if not path.is_file():
            return
        record = json.loads(path.read_text())
        samples = [Sample(**s) for s in record["samples"]]
        self.pending = Launched(record["step"], record["idx"], record["version"], None, [], samples)

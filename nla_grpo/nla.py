"""Read activations with a trained NLA: ``NLA.load(path)``, then ``verbalize``, ``reconstruct``, ``score`` and ``read``.

The verbaliser runs in the rollout engine class training uses (``rollout.vllm.engine.VllmEngine`` on a GPU,
``rollout.hf_engine.HfEngine``'s HF ``generate()`` elsewhere), with the run's own prompt, chat template,
injection, sampling (temperature 1), stops and explanation extraction; the reconstructor is the critic class
training scores with; activations come from the extraction code (``dataprep.extract.Extractor``) at the NLA's
layer. Nothing here re-implements any of them, so a reading and a training eval of the same position are one
computation.

    from nla_grpo import NLA
    nla = NLA.load("runs/pipeline-tiny")
    for r in nla.read(["the tower by the sea"], positions="all"):
        print(r["token"], r["explanation"], round(r["fve"], 3))
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from nla_grpo.parts import NlaParts, from_parts, locate
from nla_grpo.shared.errors import NlaInputError

# sampling seeds: position p of document d, sample j -> one request id, the same in every run and resume
_DOC_STRIDE, _SAMPLE_STRIDE = 1 << 20, 1 << 40


def parse_positions(text: str):
    """``all`` | ``stride:K`` | ``from:N`` -> (kind, number); one line for anything else."""
    m = re.fullmatch(r"(all)|(stride|from):(\d+)", str(text).strip())
    if not m:
        raise NlaInputError("--positions", f"expected all, stride:K or from:N, found {text!r}")
    if m.group(1):
        return "all", 0
    k = int(m.group(3))
    if m.group(2) == "stride" and k < 1:
        raise NlaInputError("--positions", f"stride:K: expected K >= 1, found {k}")
    return m.group(2), k


def positions_of(n_tokens: int, positions) -> list[int]:
    """The token indices of a document of ``n_tokens`` tokens that ``positions`` asks for."""
    kind, k = parse_positions(positions) if isinstance(positions, str) else positions
    if kind == "all":
        return list(range(n_tokens))
    if kind == "stride":
        return list(range(0, n_tokens, k))
    return list(range(k, n_tokens))


READ_CRITIC_MICRO_BATCH = 128
"""Explanations the reconstructor scores at once when reading. Training's ``critic.micro_batch`` (16) is sized for a
backward beside the learner; a reading keeps no activations, and at 16 an 8B-shape critic of 25 blocks is bound by
its per-call kernel launches (2,048 near-empty explanations in 128 calls took 8.5 s at the 8B shape)."""


class NLA:
    """A trained NLA: verbaliser + reconstructor, the subject model they read, and the settings they were trained with."""

    def __init__(self, parts: NlaParts, device: str | None = None, backend: str = "auto", max_tokens: int = 512,
                 gpu_share: float = 0.6, max_batch: int = 512, lora: str = "auto", vector_input: str = "auto",
                 critic_lora: str = "merged"):
        import torch

        self.parts, self.cfg, self.spec = parts, parts.cfg, parts.spec
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if backend not in ("auto", "hf", "vllm"):
            raise NlaInputError("backend", f"expected auto, hf or vllm, found {backend!r}")
        self.backend = backend if backend != "auto" else ("vllm" if self.device.startswith("cuda") else "hf")
        self.max_tokens = max_tokens
        # vLLM on a GPU shared with the reconstructor and the extractor (nothing trains): its share of the memory
        # and the samples it decodes at once
        self.gpu_share, self.max_batch = gpu_share, max_batch
        for field, value, allowed in (("lora", lora, ("auto", "adapter", "merged")),
                                      ("vector_input", vector_input, ("auto", "prompt_embeds", "multimodal")),
                                      ("critic_lora", critic_lora, ("merged", "adapter"))):
            if value not in allowed:
                raise NlaInputError(field, f"expected {', '.join(allowed)}, found {value!r}")
        if self.backend != "vllm" and (lora == "merged" or vector_input == "multimodal"):
            raise NlaInputError("backend", f"lora={lora!r}, vector_input={vector_input!r} are vLLM's routes; found backend {self.backend!r}")
        self.lora, self.vector_input = lora, vector_input
        # the reconstructor never trains here: its LoRA folded into the base weights (merged) leaves each linear one
        # GEMM; adapter keeps training's form (the adapters beside the base)
        self.critic_lora = critic_lora
        self.fve_baseline = parts.fve_baseline
        self._engine = self._critic = self._extractor = self._tokenizer = self._prompt = self._route = None
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the reading prints its own progress

    # ---- loading ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, path, **kwargs) -> "NLA":
        """The NLA of a pipeline run, an RL run (its newest checkpoint) or an export (``nla-grpo export``)."""
        return cls(locate(path), **kwargs)

    @classmethod
    def from_parts(cls, adapter, critic, sidecar, model=None, config=None, **kwargs) -> "NLA":
        """An NLA from an AV adapter, a critic checkpoint and the data sidecar they were trained on."""
        return cls(from_parts(adapter, critic, sidecar, model=model, config=config), **kwargs)

    def describe(self) -> str:
        return (f"NLA {self.parts.source}: layer {self.spec.layer_index}, d={self.spec.d_model}, verbaliser on {self.backend} "
                f"({self.device}), FVE baseline {self.fve_baseline:.4f}")

    # ---- the services, built on first use --------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from nla_grpo.shared.model_checks import load_tokenizer

            self._tokenizer = load_tokenizer(self.parts.subject)
        return self._tokenizer

    def route(self) -> dict:
        """How the verbaliser's engine takes the adapter and the vector (``rollout.lora``, ``rollout.vector_input``).
        ``auto`` on a GPU's vLLM: the route the colocated jobs measured faster, the adapter merged into the weights
        once (nothing trains; not a checkpoint saved quantised) and, in embed mode on a checkpoint with the
        marker-input class, the marker's row as a multimodal item on vLLM's V2 runner; elsewhere the run's own."""
        if self._route is not None:
            return dict(self._route)
        from nla_grpo.shared.model_facts import architectures, saved_quantization
        from nla_grpo.shared.resolve import MARKER_INPUT_ARCHITECTURES

        ro = self.cfg.rollout
        gpu_vllm = self.backend == "vllm" and self.device.startswith("cuda")
        lora, vector_input = self.lora, self.vector_input
        if lora == "auto":
            lora = "merged" if gpu_vllm and saved_quantization(self.cfg.model.path) is None else ro.lora
        if vector_input == "auto":
            archs = architectures(self.cfg.model.path)
            fits = self.cfg.injection.mode == "embed" and bool(archs) and archs[0] in MARKER_INPUT_ARCHITECTURES
            vector_input = "multimodal" if gpu_vllm and fits else ro.vector_input
        self._route = {"lora": lora, "vector_input": vector_input}
        return dict(self._route)

    def _engine_for(self, samples: int):
        update = {"group_size": int(samples), "backend": self.backend, **self.route()}
        if self.backend == "vllm" and self.device.startswith("cuda"):
            update.update(gpu_memory_utilization=self.gpu_share, max_num_seqs=self.max_batch, num_engines=1,
                          max_prompt_tokens=len(self._prompt_ids()[0]),
                          engine_options={"max_model_len": len(self._prompt_ids()[0]) + self.cfg.rollout.max_new_tokens + 16,
                                          **self.cfg.rollout.engine_options})
        rollout = self.cfg.rollout.model_copy(update=update)
        if self._engine is None:
            # an engine on its own (placement split): its share is the one set above, not a training step's plan
            cfg = self.cfg.model_copy(update={"rollout": rollout, "placement": self.cfg.placement.model_copy(update={"mode": "split"})})
            if self.backend == "vllm":
                from nla_grpo.rollout.vllm.engine import VllmEngine

                self._engine = VllmEngine(cfg, self.spec, self.device)
            else:
                from nla_grpo.rollout.hf_engine import HfEngine

                self._engine = HfEngine(cfg, self.spec, self.device)
            if self.parts.adapter is not None:
                self._engine.load_adapter(read_adapter(self.parts.adapter, version=1))
        # both engines read the group size from their config at each call
        self._engine.cfg = self._engine.cfg.model_copy(update={"rollout": rollout})
        return self._engine

    @property
    def critic(self):
        if self._critic is None:
            from nla_grpo.critic.scoring import Critic

            # the reconstructor's backbone is the subject model's (an export's verbaliser is merged: not its base);
            # it scores without gradients here, in larger micro-batches than training's (READ_CRITIC_MICRO_BATCH)
            critic = self.cfg.critic.model_copy(update={"micro_batch": max(self.cfg.critic.micro_batch, READ_CRITIC_MICRO_BATCH)})
            cfg = self.cfg.model_copy(update={"model": self.cfg.model.model_copy(update={"path": str(self.parts.subject)}),
                                              "critic": critic})
            self._critic = Critic(cfg, self.spec, device=self.device)
            if self.critic_lora == "merged":
                self._critic.model.merge_lora()
        return self._critic

    def _prompt_ids(self) -> tuple[list[int], int]:
        """The AV prompt (the sidecar's template, the run's chat template and prefill) and its marker site."""
        if self._prompt is None:
            from nla_grpo.shared.prompts import INJECT_PLACEHOLDER, find_marker_site, render_av_ids

            messages = [{"role": "user", "content": self.spec.av_template.format(injection_char=INJECT_PLACEHOLDER)}]
            ids = render_av_ids(self.tokenizer, messages, self.spec.marker, self.cfg.rollout.prefill, self.cfg.prompts.enable_thinking)
            try:
                site = find_marker_site(ids, self.spec.marker_id, self.spec.left_id, self.spec.right_id)
            except ValueError as exc:
                raise NlaInputError(self.spec.path, f"prompt_templates.actor: {exc}") from None
            self._prompt = (ids, site)
        return self._prompt

    def _check_vectors(self, vectors) -> np.ndarray:
        v = np.asarray(vectors, dtype=np.float32)
        if v.ndim == 1:
            v = v[None, :]
        if v.ndim != 2 or v.shape[1] != self.spec.d_model:
            raise NlaInputError("vectors", f"expected shape (n, {self.spec.d_model}) (the NLA's width), found {tuple(np.shape(vectors))}")
        if not np.isfinite(v).all():
            raise NlaInputError("vectors", "expected finite values")
        return v

    # ---- the three operations ---------------------------------------------------------------------
    def verbalize(self, vectors, samples: int = 1, seed: int = 0, ids=None) -> list[list[str | None]]:
        """``samples`` explanations per vector (None where a sample gave none), sampled as training samples.
        ``ids``: one integer per vector naming its sampling stream (default 0..n-1)."""
        import torch

        from nla_grpo.learner.reward import explanation_for
        from nla_grpo.shared.types import PromptRequest

        v = self._check_vectors(vectors)
        if samples < 1:
            raise NlaInputError("samples", f"expected >= 1, found {samples}")
        ids_ = list(range(len(v))) if ids is None else [int(i) for i in ids]
        prompt, site = self._prompt_ids()
        requests = [PromptRequest(i, list(prompt), site, torch.from_numpy(v[k].copy())) for k, i in enumerate(ids_)]
        out = self._engine_for(samples).generate(requests, seed=seed) if requests else []
        expl = [explanation_for(s.text, s.finish_reason, s.marker_echo, self.cfg.rollout.cap_is_failure) for s in out]
        return [expl[k * samples:(k + 1) * samples] for k in range(len(v))]

    def reconstruct(self, texts: list[str]) -> np.ndarray:
        """The reconstructor's vector for each explanation, at the norm its MSE compares (NaN rows where a text
        is empty or too long for it)."""
        from nla_grpo.shared.schema import normalize_activation

        ids = self.critic.encode(list(texts))
        out = np.full((len(ids), self.spec.d_model), np.nan, dtype=np.float32)
        ok = [i for i, x in enumerate(ids) if x is not None]
        if ok:
            pred = self.critic.predict_ids([ids[i] for i in ok])
            out[ok] = normalize_activation(pred, self.spec.mse_scale).numpy()
        return out

    def score(self, texts: list[str | None], vectors) -> list[float | None]:
        """The reconstructor's normalised MSE of each explanation against its vector (None: no explanation)."""
        v = self._check_vectors(vectors)
        if len(texts) != len(v):
            raise NlaInputError("texts", f"expected one text per vector ({len(v)}), found {len(texts)}")
        return self.critic.score(list(texts), v)

    def fve(self, mse: float | None) -> float | None:
        return None if mse is None or not math.isfinite(mse) else 1.0 - mse / self.fve_baseline

    # ---- reading documents ------------------------------------------------------------------------
    @property
    def extractor(self):
        if self._extractor is None:
            import torch

            from nla_grpo.dataprep.extract import Extractor
            from nla_grpo.shared.torch_utils import resolve_dtype

            self._extractor = Extractor(self.parts.subject, self.spec.layer_index, self.device,
                                        resolve_dtype(self.cfg.model.dtype, self.device) if self.cfg.model.dtype != "auto" else torch.float32)
        return self._extractor

    def tokens(self, text: str) -> list[int]:
        """A document's token ids as extraction reads it (special tokens added, cut at ``max_tokens``)."""
        from nla_grpo.shared.prompts import as_ids

        return as_ids(self.tokenizer(text, add_special_tokens=True, truncation=True, max_length=self.max_tokens)["input_ids"])

    def activations(self, token_ids: list[int], positions: list[int]) -> np.ndarray:
        """The residual after the NLA's layer at ``positions`` of one tokenised document."""
        h = self.extractor.residuals([token_ids])[0]
        return h[positions].numpy().astype(np.float32)

    def read_document(self, text: str, positions="all", samples: int = 1, seed: int = 0, doc_index: int = 0,
                      doc_id: str | None = None) -> tuple[list[str], list[dict]]:
        """(every token's text, one record per read position) for one document."""
        ids = self.tokens(text)
        where = positions_of(len(ids), positions)
        pieces = [self.tokenizer.decode([t]) for t in ids]
        if not where:
            return pieces, []
        vectors = self.activations(ids, where)
        streams = [doc_index * _DOC_STRIDE + p for p in where]
        said = self.verbalize(vectors, samples=samples, seed=seed, ids=streams)
        flat = [e for group in said for e in group]
        mses = self.score(flat, np.repeat(vectors, samples, axis=0))
        records = []
        for k, p in enumerate(where):
            group, group_mse = said[k], mses[k * samples:(k + 1) * samples]
            finite = [(m, j) for j, m in enumerate(group_mse) if m is not None and math.isfinite(m)]
            best = min(finite)[1] if finite else 0
            mse = group_mse[best] if finite else None
            records.append({"doc_index": doc_index, "doc_id": doc_id if doc_id is not None else f"doc-{doc_index}",
                            "token_index": p, "token": pieces[p], "explanation": group[best], "mse": mse, "fve": self.fve(mse),
                            "explanations": list(group), "mses": [None if m is None else float(m) for m in group_mse]})
        return pieces, records

    def read(self, texts: list[str], positions="all", samples: int = 1, seed: int = 0) -> list[dict]:
        """One record per read position of each text: ``doc_index``, ``token_index``, ``token``, the best
        ``explanation`` of the ``samples`` drawn (the one the reconstructor reads best), its ``mse`` and ``fve``,
        and every sample's ``explanations`` and ``mses``."""
        out = []
        for d, text in enumerate(texts):
            out.extend(self.read_document(text, positions, samples, seed, doc_index=d)[1])
        return out

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None


def read_adapter(path: Path, version: int):
    """An adapter directory as the ``AdapterUpdate`` the engines load (the learner's push, from disk)."""
    import json

    from safetensors.torch import load_file

    from nla_grpo.shared.adapter import AdapterDir
    from nla_grpo.shared.types import AdapterUpdate

    adapter = AdapterDir.read(path, "verbaliser adapter")
    adapter.check_files("verbaliser adapter")
    config = json.loads((Path(path) / "adapter_config.json").read_text(encoding="utf-8"))
    return AdapterUpdate(version=version, tensors=load_file(str(adapter.weights)), peft_config=config)

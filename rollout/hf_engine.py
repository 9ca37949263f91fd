"""The reference backend: HF ``generate()`` once per prompt with the group expanded (baseline and fallback).

Old logprobs come from the raw logits (``output_logits``), never from the processed scores, which
turn filtered tokens into -inf. Supports both injection modes: ``embed`` through ``inputs_embeds``
built by ``shared.injection.embed_batch``, ``karvonen`` through ``shared.injection.KarvonenHook``.
"""
from __future__ import annotations

from nla_grpo.rollout.engine import RolloutEngine, SampleBuilder, check_request, model_dir, request_vector, sample_seed, stop_token_ids
from nla_grpo.shared.types import AdapterUpdate, PromptRequest, Sample


def lora_config_from_dict(peft_config: dict):
    """A ``LoraConfig`` from ``LoraConfig.to_dict()`` output (unknown keys dropped)."""
    import dataclasses

    from peft import LoraConfig

    names = {f.name for f in dataclasses.fields(LoraConfig)}
    kwargs = {k: v for k, v in peft_config.items() if k in names and k not in ("peft_type", "base_model_name_or_path")}
    return LoraConfig(**kwargs)


class HfEngine(RolloutEngine):
    """HF transformers + PEFT rollout engine with the reference trainer's sampling behaviour."""

    def describe(self) -> str:
        return f"HF transformers on {self.device}, {self.cfg.injection.mode} injection"

    def __init__(self, cfg, spec, device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from nla_grpo.shared.injection import KarvonenHook, embed_norm
        from nla_grpo.shared.torch_utils import resolve_dtype

        self.cfg, self.spec, self.device = cfg, spec, torch.device(device)
        path = model_dir(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        dtype = resolve_dtype(cfg.model.dtype, device)
        if cfg.model.quantization == "none":
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()
        else:  # the learner's NF4 base (shared.quantization), where device_map puts it
            from nla_grpo.shared.quantization import hf_quantization_kwargs, require_gpu

            require_gpu(cfg.model.quantization, device)
            self.model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, device_map={"": self.device},
                **hf_quantization_kwargs(cfg.model.quantization, dtype, path)).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.stop_ids = stop_token_ids(path, self.tokenizer, cfg.rollout.extra_stop_tokens)
        self.scale = (spec.injection_scale(cfg.injection.scale, embed_norm=embed_norm(self.model.get_input_embeddings().weight))
                      if cfg.injection.mode == "embed" else None)  # karvonen needs no scale
        self.mode = cfg.injection.mode
        self.hook = KarvonenHook(self.model, cfg.injection.karvonen_layer) if self.mode == "karvonen" else None
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.stop_ids[0])
        self.builder = SampleBuilder(self.tokenizer, spec, self.stop_ids, cfg.rollout.prefill, cfg.rollout.max_new_tokens)
        self._version = 0
        self._adapter = None

    @property
    def adapter_version(self) -> int:
        return self._version

    # -- generation --------------------------------------------------------------------------------

    def _generation_kwargs(self, ignore_eos: bool) -> dict:
        from transformers import GenerationConfig

        ro = self.cfg.rollout
        # an explicit config, so the checkpoint's own sampling defaults (top_p, top_k, penalties) never apply
        gen_cfg = GenerationConfig(
            do_sample=True, temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
            max_new_tokens=ro.max_new_tokens, min_new_tokens=0, pad_token_id=self.pad_id,
            # ignore_eos: no stopping criterion at all; stop ids stay sampleable, as in vLLM
            eos_token_id=None if ignore_eos else list(self.stop_ids),
            return_dict_in_generate=True, output_logits=True,
        )
        return dict(generation_config=gen_cfg)

    def _generate_group(self, req: PromptRequest, seed: int, ignore_eos: bool, inject: bool):
        """(response ids [G, n], logprobs [G, n]) for one prompt, untrimmed."""
        import torch

        from nla_grpo.shared.injection import embed_batch

        G = self.cfg.rollout.group_size
        ids = torch.tensor([req.prompt_ids], dtype=torch.long, device=self.device).expand(G, -1).contiguous()
        vectors = request_vector(req, self.spec.d_model).to(self.device).unsqueeze(0).expand(G, -1)
        sites = torch.full((G,), int(req.site) if inject else -1, dtype=torch.long, device=self.device)
        mask = torch.ones_like(ids)
        # HF sampling draws from the global torch RNG: seed it per request for reproducible groups
        torch.manual_seed(sample_seed(seed, req.row_id))
        kwargs = self._generation_kwargs(ignore_eos)
        with torch.no_grad():
            if self.mode == "embed":
                embeds = embed_batch(ids, self.model.get_input_embeddings(), sites, vectors, self.scale)
                out = self.model.generate(inputs_embeds=embeds, attention_mask=mask, **kwargs)
            else:
                if inject:
                    self.hook.set(sites, vectors)
                try:
                    out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
                finally:
                    self.hook.clear()
        steps = len(out.logits)
        # with inputs_embeds only, sequences hold just the new tokens; with input_ids, prompt + new
        new_ids = out.sequences[:, -steps:] if steps else out.sequences[:, :0]
        logits = torch.stack(out.logits, dim=1).float() if steps else torch.zeros(G, 0, 1)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, new_ids.unsqueeze(-1)).squeeze(-1)
        return new_ids.cpu(), logp.cpu()

    def generate(self, requests: list[PromptRequest], seed: int, ignore_eos: bool = False, inject: bool = True) -> list[Sample]:
        samples = []
        for req in requests:
            check_request(req, self.spec)
            new_ids, logp = self._generate_group(req, seed, ignore_eos, inject)
            for g in range(new_ids.shape[0]):
                samples.append(self.builder.build(req, g, new_ids[g].tolist(), logp[g].tolist(), self._version, trim=not ignore_eos))
        return samples

    # -- teacher-forced logprobs (parity checks) ----------------------------------------------------

    def recompute_logprobs(self, samples: list[Sample], vectors, micro_batch: int = 16) -> list[list[float]]:
        """Logprobs of each sample's response tokens under the current adapter, same injection.

        ``vectors[i]`` is sample i's activation (a sequence of floats or a 1-D tensor);
        ``vectors=None`` recomputes without injection.
        """
        import torch

        from nla_grpo.shared.torch_utils import right_pad
        from nla_grpo.shared.injection import embed_batch

        inject = vectors is not None
        if not inject:
            vectors = [torch.ones(self.spec.d_model)] * len(samples)
        if len(vectors) != len(samples):
            raise ValueError(f"{len(samples)} samples but {len(vectors)} vectors")
        result: list[list[float]] = []
        for start in range(0, len(samples), micro_batch):
            chunk = samples[start:start + micro_batch]
            seqs = [s.prompt_ids + s.response_ids for s in chunk]
            ids, mask = right_pad(seqs, self.pad_id, self.device)
            vecs = torch.stack([
                torch.as_tensor(vectors[start + i], dtype=torch.float32).reshape(-1) for i in range(len(chunk))
            ]).to(self.device)
            sites = torch.tensor([s.site if inject else -1 for s in chunk], dtype=torch.long, device=self.device)
            with torch.no_grad():
                if self.mode == "embed":
                    embeds = embed_batch(ids, self.model.get_input_embeddings(), sites, vecs, self.scale)
                    logits = self.model(inputs_embeds=embeds, attention_mask=mask).logits
                else:
                    if inject:
                        self.hook.set(sites, vecs)
                    try:
                        logits = self.model(input_ids=ids, attention_mask=mask).logits
                    finally:
                        self.hook.clear()
            logp = torch.log_softmax(logits.float(), dim=-1)
            for i, s in enumerate(chunk):
                p, n = len(s.prompt_ids), len(s.response_ids)
                targets = ids[i, p:p + n]
                result.append(logp[i, p - 1:p - 1 + n].gather(-1, targets.unsqueeze(-1)).squeeze(-1).cpu().tolist())
        return result

    # -- adapters -----------------------------------------------------------------------------------

    def load_adapter(self, update: AdapterUpdate) -> None:
        """Build the new version as its own PEFT adapter (new name), activate it, drop the old one."""
        from peft import get_peft_model, set_peft_model_state_dict

        from nla_grpo.rollout.vllm.adapter_registry import adapter_name, check_update

        check_update(update, self._version)
        name = adapter_name(update.version)
        config = lora_config_from_dict(update.peft_config)
        if self._adapter is None:
            self.model = get_peft_model(self.model, config, adapter_name=name)
        else:
            self.model.add_adapter(name, config)
        result = set_peft_model_state_dict(self.model, update.tensors, adapter_name=name)
        missing = [k for k in getattr(result, "missing_keys", []) if name in k and "lora_" in k]
        unexpected = list(getattr(result, "unexpected_keys", []))
        if missing or unexpected:
            raise ValueError(f"adapter version {update.version}: missing {missing[:3]}, unexpected {unexpected[:3]} tensor names")
        self.model.set_adapter(name)
        if self._adapter is not None:
            self.model.delete_adapter(self._adapter)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._adapter, self._version = name, update.version

    def close(self) -> None:
        if getattr(self, "hook", None) is not None:
            self.hook.remove()
            self.hook = None
        self.model = None

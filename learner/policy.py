"""The learner's policy: base LLM + trainable LoRA "default" + frozen LoRA "reference", and the
forward that turns a padded micro-batch (with the activation injected) into per-token response
logprobs.

The reference adapter is a copy of the *initial* policy adapter, so the KL term anchors to the
starting verbaliser rather than to the bare base model (which ``disable_adapter()`` would give).
Injection goes through ``shared.injection`` so the learner scores exactly the policy the rollout
engines sample from.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from nla_grpo.learner.packing import PackedBatch, unpack_tokens
from nla_grpo.learner.token_logprobs import token_logprobs
from nla_grpo.shared.injection import KarvonenHook, embed_batch, embed_norm

POLICY = "default"
REFERENCE = "reference"


@dataclass
class MicroBatch:
    """Right-padded prompt+response ids of a few samples and what the forward needs to score them."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    sites: torch.Tensor  # [B] marker position in each prompt
    vectors: torch.Tensor  # [B, d] fp32 activations
    prompt_lens: torch.Tensor  # [B]
    response_lens: torch.Tensor  # [B]


def pad_batch(prompts: list[list[int]], responses: list[list[int]], sites: list[int], vectors: torch.Tensor,
              pad_id: int, device) -> MicroBatch:
    """Right-pad ``prompt + response`` rows; padding is masked out of attention and never scored."""
    from nla_grpo.shared.torch_utils import right_pad

    ids, attn = right_pad([list(p) + list(r) for p, r in zip(prompts, responses)], pad_id, device)
    return MicroBatch(
        input_ids=ids,
        attention_mask=attn,
        sites=torch.tensor(sites, dtype=torch.long, device=device),
        vectors=vectors.to(device=device, dtype=torch.float32),
        prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device),
        response_lens=torch.tensor([len(r) for r in responses], dtype=torch.long, device=device),
    )


def logits_to_keep(batch: MicroBatch) -> int:
    """How many trailing positions need logits: from the first position that predicts a response token."""
    return batch.input_ids.shape[1] - int(batch.prompt_lens.min()) + 1


def response_logprobs(logits: torch.Tensor, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp[B, T], mask[B, T])``: log P(response token t | everything before it), fp32.

    Token ``t`` of row ``b`` sits at ``prompt_len + t`` and is predicted by the logits one position
    earlier. ``logits`` may cover only the last positions of the sequence (``logits_to_keep``).
    Only the predicting rows are normalised, never the whole prompt.
    """
    B, K, V = logits.shape
    L = batch.input_ids.shape[1]
    T = max(int(batch.response_lens.max()), 1)
    t = torch.arange(T, device=logits.device)
    mask = t.unsqueeze(0) < batch.response_lens.unsqueeze(1)
    pos = (batch.prompt_lens.unsqueeze(1) - 1 + t.unsqueeze(0)).clamp(L - K, L - 2)
    picked = logits.gather(1, (pos - (L - K)).unsqueeze(-1).expand(B, T, V))
    logp = torch.log_softmax(picked.float(), dim=-1)
    targets = batch.input_ids.gather(1, pos + 1)
    tok = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return torch.where(mask, tok, torch.zeros_like(tok)), mask


def adapter_parameters(model, name: str) -> dict[str, torch.nn.Parameter]:
    """Live LoRA parameters of adapter ``name`` keyed as PEFT saves them (the adapter name dropped)."""
    tag = f".{name}"
    return {n.replace(tag, ""): p for n, p in model.named_parameters() if "lora_" in n and f"{tag}." in n}


def _fresh_lora_config(cfg):
    from peft import LoraConfig

    lc = cfg.learner
    return LoraConfig(
        r=lc.lora_r, lora_alpha=lc.lora_alpha, use_rslora=lc.use_rslora, target_modules=list(lc.target_modules),
        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
    )


def load_base_model(cfg, device):
    """The frozen base LLM in the configured dtype (NF4 through ``shared.quantization`` on request, GPU only)."""
    from transformers import AutoModelForCausalLM

    from nla_grpo.shared.torch_utils import resolve_dtype

    dtype = resolve_dtype(cfg.model.dtype, device)
    gc = cfg.learner.gradient_checkpointing
    kwargs = {"dtype": dtype}
    if cfg.learner.forward == "packed" and torch.device(device).type == "cpu":
        # packed rows need a 4-D mask; on the CPU eager attention rounds a sample's scores the same
        # wherever its response sits in the row (sdpa's blocked kernel does not quite)
        kwargs["attn_implementation"] = "eager"
    quantized = cfg.model.quantization != "none"
    if quantized:
        from nla_grpo.shared.quantization import hf_quantization_kwargs, require_gpu

        require_gpu(cfg.model.quantization, device)
        kwargs.update(hf_quantization_kwargs(cfg.model.quantization, dtype, cfg.model.path))
        kwargs["device_map"] = {"": torch.device(device)}
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, **kwargs)
    model.config.use_cache = False
    if not quantized:
        model.to(device)
    return freeze_base(model, gc, fp32_modules=quantized and cfg.learner.nf4_fp32_modules)


def freeze_base(model, checkpointing: bool, fp32_modules: bool = False):
    """The loaded base made ready for LoRA training: every parameter frozen, gradient checkpointing on
    request. ``fp32_modules`` (``learner.nf4_fp32_modules``): PEFT's ``prepare_model_for_kbit_training``
    instead, which also casts every unquantised parameter (norms, embeddings, LM head) to fp32."""
    # non-reentrant checkpointing needs no input that requires grad (the embeddings are frozen)
    gc_kwargs = {"use_reentrant": False}
    if fp32_modules:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing,
                                                gradient_checkpointing_kwargs=gc_kwargs)
    elif checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _check_adapter_targets(peft_config, where: str) -> None:
    from nla_grpo.shared.adapter import linear_only_problem

    problem = linear_only_problem(peft_config.target_modules, getattr(peft_config, "modules_to_save", None))
    if problem:
        raise ValueError(f"{where}: {problem}")
    if getattr(peft_config, "bias", "none") != "none":
        raise ValueError(f"{where}: expected bias='none' (vLLM serves LoRA without bias terms), found {peft_config.bias!r}")


def build_peft_model(cfg, device):
    """Base + trainable "default" + frozen "reference" (= the initial "default", tensor for tensor, unless
    ``learner.reference_adapter`` names another adapter)."""
    from peft import PeftModel, get_peft_model

    base = load_base_model(cfg, device)
    if cfg.learner.adapter_init:
        init = cfg.learner.adapter_init
        model = PeftModel.from_pretrained(base, init, adapter_name=POLICY, is_trainable=True)
        _check_adapter_targets(model.peft_config[POLICY], f"learner.adapter_init {init}")
        model.load_adapter(init, adapter_name=REFERENCE, is_trainable=False)
        _disable_lora_dropout(model)
    else:
        config = _fresh_lora_config(cfg)
        # seeded and isolated: the same config gives the same initial adapter in every process,
        # without disturbing the caller's RNG stream
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = get_peft_model(base, config, adapter_name=POLICY)
            model.add_adapter(REFERENCE, _fresh_lora_config(cfg))
        policy, reference = adapter_parameters(model, POLICY), adapter_parameters(model, REFERENCE)
        with torch.no_grad():
            for key, p in policy.items():
                reference[key].copy_(p)
    reference = cfg.learner.reference_adapter
    if reference and reference != cfg.learner.adapter_init:
        # the KL anchor given apart from the policy's start (a resumed reference-trainer run: policy = its
        # iteration's adapter, reference = the AV-SFT one)
        model.delete_adapter(REFERENCE)
        model.load_adapter(reference, adapter_name=REFERENCE, is_trainable=False)
        _check_adapter_targets(model.peft_config[REFERENCE], f"learner.reference_adapter {reference}")
        _disable_lora_dropout(model)
        policy, ref = adapter_parameters(model, POLICY), adapter_parameters(model, REFERENCE)
        if policy.keys() == ref.keys() and all(torch.equal(policy[k].float(), ref[k].float()) for k in policy):
            warnings.warn(f"learner.reference_adapter {reference}: the policy starts identical to it; a resumed run's "
                          "policy should have moved away from its reference (is adapter_init the right adapter?)",
                          RuntimeWarning, stacklevel=2)
    select_adapter(model, POLICY)
    return model


def _disable_lora_dropout(model) -> None:
    """A saved SFT adapter may carry lora_dropout: in train mode it would make the learner's scores
    random while vLLM never drops anything (ratio, KL and mismatch would all pick up noise)."""
    for module in model.modules():
        drop = getattr(module, "lora_dropout", None)
        if isinstance(drop, torch.nn.ModuleDict):
            for key in list(drop.keys()):
                drop[key] = torch.nn.Identity()


def select_adapter(model, name: str) -> None:
    """Make ``name`` the active adapter and pin trainability: only "default" ever requires grad.

    PEFT's ``set_adapter`` flips requires_grad to follow the active adapter; re-pinning keeps the
    reference frozen whatever is active.
    """
    model.set_adapter(name, inference_mode=name != POLICY)
    for p in adapter_parameters(model, REFERENCE).values():
        p.requires_grad_(False)
    for p in adapter_parameters(model, POLICY).values():
        p.requires_grad_(True)


class Policy:
    """The PEFT model plus the injection that every forward of it applies."""

    def __init__(self, cfg, spec, device: str = "cpu"):
        self.cfg, self.spec, self.device = cfg, spec, torch.device(device)
        self.model = build_peft_model(cfg, device)
        self.mode = cfg.injection.mode
        emb = self.model.get_input_embeddings()
        # karvonen adds ||h||·v/||v||: no scale (the sidecar may have none)
        self.scale = spec.injection_scale(cfg.injection.scale, embed_norm=embed_norm(emb.weight)) if cfg.injection.mode == "embed" else None
        self.hook = KarvonenHook(self.model, cfg.injection.karvonen_layer) if self.mode == "karvonen" else None
        pad = self.model.config.pad_token_id
        self.pad_id = int(pad[0] if isinstance(pad, list) else pad) if pad is not None else 0
        self.packed = False
        self.attention = "sdpa"
        self._dense_attention = self.model.get_base_model().config._attn_implementation  # sdpa, or eager on the CPU
        self.use_forward(cfg.learner.forward)
        from nla_grpo.learner import kernels

        self.kernels = kernels.resolve(cfg.learner.kernels, self.device)
        kernels.install(self.model, self.kernels)

    def use_forward(self, kind: str) -> None:
        """``packed`` (fused LoRA, shared-prefix rows, chunked head) or ``padded`` (PEFT's forward, padded rows);
        the packed rows' attention as ``learner.attention`` resolves (``learner.packed_attention``)."""
        from nla_grpo.learner import lora_compute, packed_attention

        config = self.model.get_base_model().config
        config._attn_implementation = self._dense_attention
        if kind == "packed":
            _check_packable(config)
            if getattr(self.model.get_base_model().get_output_embeddings(), "bias", None) is not None:
                raise ValueError("learner.forward packed: the model's LM head has a bias, which the packed head "
                                 "does not add; set learner.forward: padded")
            lora_compute.install(self.model)
        else:
            lora_compute.uninstall(self.model)
        self.packed = kind == "packed"
        # the activations' dtype: the embeddings' (fp32 under learner.nf4_fp32_modules, whatever model.dtype says)
        dtype = self.model.get_input_embeddings().weight.dtype
        self.attention = packed_attention.resolve(self.cfg.learner.attention, self.device, self.packed, dtype)
        if self.attention == "flex":
            config._attn_implementation = packed_attention.register()
        elif self.attention == "varlen":
            from nla_grpo.learner import varlen_attention

            config._attn_implementation = varlen_attention.register()

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return list(adapter_parameters(self.model, POLICY).values())

    def adapter_parameters(self, name: str) -> dict[str, torch.nn.Parameter]:
        return adapter_parameters(self.model, name)

    def batch(self, prompts, responses, sites, vectors) -> MicroBatch:
        return pad_batch(prompts, responses, sites, vectors, self.pad_id, self.device)

    @contextlib.contextmanager
    def injecting(self, batch: MicroBatch):
        """Arm the karvonen hook for ``batch``. Keep the block open through backward: gradient
        checkpointing re-runs the hooked block there, and a disarmed hook would recompute a different
        forward (silently wrong gradients)."""
        if self.hook is not None:
            self.hook.set(batch.sites, batch.vectors)
        try:
            yield
        finally:
            if self.hook is not None:
                self.hook.clear()

    @contextlib.contextmanager
    def using(self, adapter: str):
        """Run the enclosed forwards under ``adapter``; always back on the policy afterwards."""
        if adapter == POLICY:
            yield
            return
        select_adapter(self.model, adapter)
        try:
            yield
        finally:
            select_adapter(self.model, POLICY)

    def forward_logprobs(self, batch: MicroBatch | PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token response logprobs ``(logp[S, T], mask[S, T])`` of the active adapter, activation injected.

        Karvonen mode must run inside ``injecting(batch)``.
        """
        if self.mode == "karvonen" and self.hook.sites is None:
            raise RuntimeError("karvonen forward outside Policy.injecting(batch): the activation would be missing")
        if isinstance(batch, PackedBatch):
            return self._forward_packed(batch)
        # the lm_head runs only where a response token is predicted (the prompt is most of the sequence)
        common = dict(attention_mask=batch.attention_mask, use_cache=False, logits_to_keep=logits_to_keep(batch))
        if self.mode == "embed":
            embeds = embed_batch(batch.input_ids, self.model.get_input_embeddings(), batch.sites, batch.vectors, self.scale)
            out = self.model(inputs_embeds=embeds, **common)
        else:
            out = self.model(input_ids=batch.input_ids, **common)
        return response_logprobs(out.logits, batch)

    def _forward_packed(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder over packed rows, then the LM head on the response-predicting positions only."""
        lm = self.model.get_base_model()
        mask = batch.attention_mask
        if self.attention == "flex":
            from nla_grpo.learner.packed_attention import block_mask

            if mask is None:  # built once per micro-batch, for the policy's forward and the reference's
                mask = batch.attention_mask = block_mask(batch.segments)
        elif lm.config._attn_implementation == "eager":  # eager adds the mask to the scores
            dtype = self.model.get_input_embeddings().weight.dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
        common = dict(attention_mask=mask, position_ids=batch.position_ids, use_cache=False)
        if self.attention == "varlen":
            from nla_grpo.learner.varlen_attention import KWARG

            if batch.varlen is None:
                raise RuntimeError("learner.attention varlen: the micro-batch was packed without its layout")
            common[KWARG] = batch.varlen  # no mask: the decoder hands the layout on to every attention call
        if self.mode == "embed":
            embeds = embed_batch(batch.input_ids, self.model.get_input_embeddings(), batch.sites, batch.vectors, self.scale)
            hidden = lm.get_decoder()(inputs_embeds=embeds, **common).last_hidden_state
        else:
            hidden = lm.get_decoder()(input_ids=batch.input_ids, **common).last_hidden_state
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.pred_index)
        return unpack_tokens(token_logprobs(picked, lm.get_output_embeddings().weight, batch.targets), batch)


def _check_packable(config) -> None:
    """The packed forward calls the decoder and the LM head itself: refuse what it would get wrong."""
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        raise ValueError(f"learner.forward packed: expected sdpa or eager attention (a per-row 4-D mask), "
                         f"found {impl!r}; set learner.forward: padded")
    layer_types = getattr(config, "layer_types", None) or []
    sliding = "sliding_attention" in layer_types or bool(getattr(config, "use_sliding_window", False)) or (
        not hasattr(config, "use_sliding_window") and getattr(config, "sliding_window", None) is not None)
    if sliding:
        raise ValueError("learner.forward packed: the model uses sliding-window attention, which the packed 4-D mask "
                         "does not apply; set learner.forward: padded")
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1.0):
            raise ValueError(f"learner.forward packed: the model's {name}={getattr(config, name)} is not applied "
                             f"by the packed LM head; set learner.forward: padded")


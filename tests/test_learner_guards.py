"""Guards found in review: SFT adapters with dropout, NaN rollout logprobs, partly skipped PPO epochs,
settings that cannot work together, and the engine's LoRA limits for a loaded adapter."""
import dataclasses
import math

import pytest
import torch

from nla_grpo.learner.learner import Learner
from nla_grpo.shared.errors import NlaInputError

from test_learner_support import load_tiny_spec, make_cfg, sample_responses


@pytest.fixture(scope="module")
def rollouts(tiny_dir):
    return sample_responses(tiny_dir, "embed", n_prompts=2, group=2, max_new=5)


def _sft_adapter(tiny_dir, path, dropout):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "v_proj"],
                     rank_pattern={"v_proj": 8})
    torch.manual_seed(0)
    peft = get_peft_model(model, cfg)
    for n, p in peft.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    peft.save_pretrained(path)
    return path


def test_sft_adapter_dropout_never_randomises_the_learner(tiny_dir, tmp_path, rollouts):
    samples, vectors = rollouts
    init = _sft_adapter(tiny_dir, tmp_path / "sft", dropout=0.5)
    learner = Learner(make_cfg(tiny_dir, "embed", adapter_init=str(init)), load_tiny_spec(tiny_dir))
    items = learner.policy.batch([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                 [s.site for s in samples], torch.as_tensor(vectors, dtype=torch.float32))
    learner.model.train()
    with torch.no_grad(), learner.policy.injecting(items):
        a, _ = learner.policy.forward_logprobs(items)
        b, _ = learner.policy.forward_logprobs(items)
    assert torch.equal(a, b)


def test_engine_lora_limits_follow_the_loaded_adapter(tiny_dir, tmp_path):
    from nla_grpo.rollout.vllm.engine import adapter_shape

    init = _sft_adapter(tiny_dir, tmp_path / "sft", dropout=0.0)
    rank, targets = adapter_shape(make_cfg(tiny_dir, "embed", adapter_init=str(init)))
    assert rank == 8 and sorted(targets) == ["q_proj", "v_proj"]
    assert adapter_shape(make_cfg(tiny_dir, "embed"))[0] == make_cfg(tiny_dir, "embed").learner.lora_r
    with pytest.raises(NlaInputError, match="adapter_config.json"):
        adapter_shape(make_cfg(tiny_dir, "embed", adapter_init=str(tmp_path)))


def test_nan_rollout_logprob_masks_that_sample_only(tiny_dir, rollouts):
    samples, vectors = rollouts
    broken = [dataclasses.replace(s) for s in samples]
    broken[1].logprobs = [float("nan")] + broken[1].logprobs[1:]
    learner = Learner(make_cfg(tiny_dir, "embed", lr=1e-2, mismatch_mask_k3=0.5), load_tiny_spec(tiny_dir))
    with pytest.warns(RuntimeWarning, match="masked"):
        m = learner.update(broken, [1.0, -1.0, 0.5, -0.5], vectors)
    assert not m["skipped"] and m["masked"] == 1 and math.isfinite(m["loss"])


def test_a_later_failed_ppo_epoch_still_reports_the_step(tiny_dir, rollouts, monkeypatch):
    samples, vectors = rollouts
    learner = Learner(make_cfg(tiny_dir, "embed", ppo_epochs=2, mismatch_mask_k3=1e6), load_tiny_spec(tiny_dir))
    real, calls = learner.optimizer_step, []

    def second_fails(loss, kept):
        calls.append(1)
        return real(float("nan") if len(calls) == 2 else loss, kept)

    monkeypatch.setattr(learner, "optimizer_step", second_fails)
    m = learner.update(samples, [1.0, -1.0, 0.5, -0.5], vectors)
    assert len(calls) == 2 and not m["skipped"] and learner.version == 2


@pytest.mark.parametrize("raw,needle", [
    ({"model": {"quantization": "nf4"}}, "model.quantization=nf4: bitsandbytes NF4 needs CUDA GPUs"),
    ({"model": {"dtype": "bfloat16"}, "critic": {"train": True, "lora_r": 0}}, "critic.lora_r=0"),
    ({"placement": {"mode": "colocated"}, "critic": {"train": True}}, "critic.lora_r=0"),
    ({"rollout": {"sleep_during_update": True}}, "rollout.sleep_during_update needs placement.mode=colocated"),
    ({"placement": {"mode": "split"}, "model": {"dtype": "float32"}}, "model.dtype=float32 with the vLLM rollout on GPUs"),
    ({"placement": {"mode": "colocated"}, "weight_sync": {"kind": "broadcast"}}, "NCCL cannot join two ranks on one GPU"),
    ({"grpo": {"overlap_rollout": True}, "learner": {"ppo_epochs": 2}}, "learner.ppo_epochs > 1"),
    ({"grpo": {"overlap_rollout": True}, "rollout": {"sleep_during_update": True}, "placement": {"mode": "colocated"}},
     "grpo.overlap_rollout with rollout.sleep_during_update"),
    ({"rollout": {"sleep_during_update": True, "backend": "hf"}, "placement": {"mode": "colocated"}}, "rollout.backend=vllm"),
    ({"placement": {"mode": "split"}, "weight_sync": {"kind": "cuda_ipc"}}, "weight_sync.kind=cuda_ipc needs placement.mode=colocated"),
    ({"rollout": {"backend": "hf"}, "weight_sync": {"kind": "file"}}, "weight_sync.kind=file .* needs rollout.backend=vllm"),
    ({"injection": {"mode": "karvonen", "karvonen_layer": 2}}, r"injection.karvonen_layer: expected 0\.\.0 \(.* has 2 decoder blocks, and after the last one no attention layer is left"),
    ({"placement": {"mode": "split", "learner_gpus": 2}}, "placement.learner_gpus: expected 1"),
    ({"placement": {"mode": "split", "learner_gpus": 0}}, "placement.learner_gpus: expected 1"),
    ({"placement": {"critic_own_gpu": True}}, "placement.critic_own_gpu needs placement.mode=split"),
    ({"placement": {"mode": "colocated"}, "critic": {"lora_r": 8}, "rollout": {"num_engines": 8}}, "expected rollout.num_engines at most 4"),
    ({"placement": {"mode": "colocated"}, "critic": {"lora_r": 8}, "rollout": {"tensor_parallel_size": 2}},
     "rollout.tensor_parallel_size=1"),
])
def test_settings_that_cannot_work_together(tiny_dir, raw, needle):
    from nla_grpo.orchestrator.job import prepare_job
    from nla_grpo.shared.config import build_config

    raw = {**raw, "model": {"path": str(tiny_dir / "model"), **raw.get("model", {})},
           "data": {"parquet": str(tiny_dir / "rl.parquet")}}
    with pytest.raises(NlaInputError, match=needle):
        prepare_job(build_config(raw, "t"), log=lambda m: None)


@pytest.mark.parametrize("mode,route,resolved", [
    ("cpu", "auto", "host"), ("colocated", "auto", "cuda_ipc"), ("split", "auto", "broadcast"),
    ("split", "host", "host"), ("cpu", "broadcast", "broadcast"),
])
def test_auto_weight_sync_follows_placement(tiny_dir, mode, route, resolved):
    from nla_grpo.shared.config import build_config

    raw = {"model": {"path": str(tiny_dir / "model")}, "data": {"parquet": str(tiny_dir / "rl.parquet")},
           "placement": {"mode": mode}, "weight_sync": {"kind": route}}
    assert build_config(raw, "t").weight_sync.kind == resolved


def test_an_adapter_directory_is_checked_before_any_actor(tiny_dir, tmp_path):
    """Config, tensor file, targets and every LoRA shape, from the header and a meta-device model."""
    import json

    from safetensors.torch import load_file, save_file

    from nla_grpo.shared.model_checks import check_adapter_dir

    good = _sft_adapter(tiny_dir, tmp_path / "sft", dropout=0.0)
    check_adapter_dir(good, tiny_dir / "model", "learner.adapter_init")
    bad = tmp_path / "bad"

    def variant(edit_config=None, edit_tensors=None, drop=None):
        import shutil
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(good, bad)
        if edit_config:
            raw = json.loads((bad / "adapter_config.json").read_text())
            (bad / "adapter_config.json").write_text(json.dumps(edit_config(raw)))
        if edit_tensors:
            t = load_file(str(bad / "adapter_model.safetensors"))
            save_file(edit_tensors(t), str(bad / "adapter_model.safetensors"))
        if drop:
            (bad / drop).rename(bad / "adapter_model.bin")
        return bad

    def transposed(t):
        key = next(k for k in t if "lora_A" in k)
        return {**t, key: t[key].t().contiguous()}

    for make, needle in (
        (lambda: variant(edit_tensors=transposed), r"q_proj.lora_A.weight: expected shape \(4, 64\) for .*q_proj of .*, found \(64, 4\)"),
        (lambda: variant(edit_config=lambda r: {**r, "target_modules": ["q_proj", "embed_tokens"]}), "expected LoRA on linear modules only"),
        (lambda: variant(edit_config=lambda r: {**r, "target_modules": ["q_proj", "qq_proj"]}), r"\['qq_proj'\] not among the linear modules"),
        (lambda: variant(drop="adapter_model.safetensors"), "found adapter_model.bin, which would need unpickling"),
    ):
        with pytest.raises(NlaInputError, match=needle):
            check_adapter_dir(make(), tiny_dir / "model", "learner.adapter_init")


def test_nf4_with_vllm_needs_a_checkpoint_stored_in_the_model_dtype(tiny_dir, tmp_path):
    """vLLM quantises the stored weights and the learner the cast ones: an F32 checkpoint under bf16 NF4
    would give the rollout another base. Refused before any actor; a bf16 copy, or a checkpoint saved
    already quantised, is accepted."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from nla_grpo.orchestrator.job import prepare_job
    from nla_grpo.shared.model_checks import check_quantization_source
    from nla_grpo.shared.config import build_config
    from nla_grpo.shared.quantization import hf_quantization_kwargs, prequantized

    needle = r"model.quantization nf4: the checkpoint stores its linear weights as F32 \(.*proj.weight\) and model.dtype is bfloat16"
    with pytest.raises(NlaInputError, match=needle):
        check_quantization_source(tiny_dir / "model", "bfloat16")
    raw = {"model": {"path": str(tiny_dir / "model"), "dtype": "bfloat16", "quantization": "nf4"},
           "data": {"parquet": str(tiny_dir / "rl.parquet")}, "placement": {"mode": "colocated"}}
    with pytest.raises(NlaInputError, match=needle):
        prepare_job(build_config(raw, "t"), log=lambda *a: None)
    check_quantization_source(tiny_dir / "model", "float32")

    bf16 = tmp_path / "bf16"
    shutil.copytree(tiny_dir / "model", bf16)
    for f in bf16.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    check_quantization_source(bf16, "bfloat16")
    with pytest.raises(NlaInputError, match="as BF16"):
        check_quantization_source(bf16, "float16")
    config = json.loads((bf16 / "config.json").read_text())

    def saved_quantised(**changes):
        qc = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
              "bnb_4bit_use_double_quant": True, "bnb_4bit_quant_storage": "uint8", **changes}
        (bf16 / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))

    assert hf_quantization_kwargs("none", torch.bfloat16, bf16) == {}
    nf4 = hf_quantization_kwargs("nf4", torch.bfloat16, bf16)["quantization_config"]  # a bf16 checkpoint: quantised on load
    assert (nf4.bnb_4bit_quant_type, nf4.bnb_4bit_use_double_quant, nf4.bnb_4bit_compute_dtype) == ("nf4", True, torch.bfloat16)
    saved_quantised()  # the stored dtype is the loaders' business then, and they follow the checkpoint
    check_quantization_source(bf16, "float16")
    # no quantization_config key at all (None would mean "load unquantised"): transformers follows the checkpoint
    assert hf_quantization_kwargs("nf4", torch.bfloat16, bf16) == {}
    for changes, needle in (({"bnb_4bit_quant_storage": "bfloat16"}, r"bnb_4bit_quant_storage: expected one of \['uint8'\] .*found 'bfloat16'"),
                            ({"bnb_4bit_quant_type": "fp4"}, "bnb_4bit_quant_type: expected 'nf4'.*found 'fp4'"),
                            ({"bnb_4bit_use_double_quant": False}, "bnb_4bit_use_double_quant: expected True.*found False"),
                            ({"load_in_4bit": False, "load_in_8bit": True}, "load_in_4bit: expected True")):
        saved_quantised(**changes)
        with pytest.raises(NlaInputError, match=needle) as err:
            check_quantization_source(bf16, "bfloat16")
        assert str(err.value).startswith(str(bf16 / "config.json"))
    saved_quantised(bnb_4bit_quant_storage="bfloat16")  # transformers reads that storage: only vLLM refuses it
    assert prequantized(bf16)["bnb_4bit_quant_storage"] == "bfloat16"

    # before any actor, for either rollout backend, and under model.quantization none (which it would contradict)
    saved_quantised(bnb_4bit_quant_type="fp4")
    for backend in ("vllm", "hf"):
        raw["rollout"] = {"backend": backend}
        with pytest.raises(NlaInputError, match="bnb_4bit_quant_type: expected 'nf4'"):
            prepare_job(build_config({**raw, "model": {**raw["model"], "path": str(bf16)}}, "t"), log=lambda *a: None)
    saved_quantised()
    raw["rollout"] = {"backend": "vllm"}
    with pytest.raises(NlaInputError, match=r"model.quantization: expected nf4 \(.* is saved quantised in NF4"):
        prepare_job(build_config({**raw, "model": {"path": str(bf16), "dtype": "bfloat16"}}, "t"), log=lambda *a: None)
    # the merged engine loads the bf16 checkpoint and dequantises the learner's NF4 itself: nothing to load here
    raw["rollout"] = {"backend": "vllm", "lora": "merged"}
    with pytest.raises(NlaInputError, match=r"rollout.lora: expected adapter \(.* is saved quantised.*found merged"):
        prepare_job(build_config({**raw, "model": {"path": str(bf16), "dtype": "bfloat16", "quantization": "nf4"}}, "t"),
                    log=lambda *a: None)


def test_a_config_without_architectures_is_refused_for_vllm_before_any_actor(tiny_dir, tmp_path):
    """A config.json written from code names no architecture; vLLM would then load the model as a pooling
    model and fail at the first generate, minutes later (a 32B-shape run did). The HF backend goes by
    model_type and takes it."""
    import json
    import shutil

    from nla_grpo.orchestrator.job import prepare_job
    from nla_grpo.shared.config import build_config

    model = tmp_path / "model"
    shutil.copytree(tiny_dir / "model", model)
    config = json.loads((model / "config.json").read_text())
    assert config["architectures"]  # the fixture as saved by transformers
    raw = {"model": {"path": str(model)}, "data": {"parquet": str(tiny_dir / "rl.parquet")}}
    for missing in ({k: v for k, v in config.items() if k != "architectures"}, {**config, "architectures": None}):
        (model / "config.json").write_text(json.dumps(missing))
        with pytest.raises(NlaInputError, match=r"architectures: expected the model's generating class .* found None") as err:
            prepare_job(build_config({**raw, "rollout": {"backend": "vllm"}}, "t"), log=lambda *a: None)
        assert str(err.value).startswith(str(model / "config.json"))
        prepare_job(build_config({**raw, "rollout": {"backend": "hf"}}, "t"), log=lambda *a: None)
    (model / "config.json").write_text(json.dumps(config))
    prepare_job(build_config({**raw, "rollout": {"backend": "vllm"}}, "t"), log=lambda *a: None)

import pytest
import yaml

from nla_grpo.shared.config import RunConfig, build_config, dump_config, field_docs, load_config
from nla_grpo.shared.errors import NlaInputError

from conftest import ROOT


def test_every_field_documented():
    docs = field_docs()
    assert len(docs) > 40
    missing = [k for k, v in docs.items() if not v.strip()]
    assert not missing, f"fields without a doc string: {missing}"


def test_deploy_configs_validate():
    for path in sorted((ROOT / "deploy").glob("*.yaml")):
        if path.name.startswith("runtime-env"):
            continue
        if path.name.startswith("pipeline-"):  # a pipeline: its run config with its overrides must validate too
            from nla_grpo.orchestrator.pipeline import load_pipeline

            pipe, here = load_pipeline(path, [])
            load_config(here / pipe.config, pipe.set)
            continue
        load_config(path)


def test_overrides_and_roundtrip(tmp_path):
    cfg = load_config(ROOT / "deploy/tiny.yaml", ["grpo.steps=7", "rollout.prefill=<x>", "critic.train=false"])
    assert cfg.grpo.steps == 7 and cfg.rollout.prefill == "<x>" and cfg.critic.train is False
    p = tmp_path / "resolved.yaml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg


@pytest.mark.parametrize("raw,needle", [
    ({"rollout": {"temprature": 1.0}}, "rollout.temprature: unknown key"),
    ({"bogus": 1}, "bogus: unknown key"),
    ({"rollout": {"group_size": "eight"}}, "rollout.group_size"),
    ({"rollout": {"group_size": 1}}, "rollout.group_size"),
    ({"rollout": {"temperature": 0.7}}, "rollout.temperature: expected 1.0"),
    ({"grpo": {"clip_eps": 1.5}}, "grpo.clip_eps"),
    ({"learner": {"target_modules": ["embed_tokens"]}}, "learner.target_modules"),
    ({"learner": {"micro_batch": 0}}, "learner.micro_batch: expected 'auto' or an integer 1..4096, found 0"),
    ({"learner": {"micro_batch": "most"}}, "learner.micro_batch: expected 'auto' or an integer 1..4096, found 'most'"),
    ({"learner": {"forward": "fused"}}, "learner.forward"),
    ({"placement": {"mode": "cluster"}}, "placement.mode"),
    ({"critic": {"train": "yes"}}, "critic.train"),
    ({"injection": {"scale": "banana"}}, "injection.scale: expected a positive number, 'sqrt_d_model', 'embed_norm' or 'raw', found 'banana'"),
    ({"injection": {"scale": "-3"}}, "injection.scale: expected a positive number"),
    ({"weight_sync": {"kind": "nccl"}}, "weight_sync.kind: expected one of auto, host, cuda_ipc, broadcast, file, found 'nccl'"),
    ({"weight_sync": {"timeout_s": 5}}, "weight_sync.kind: missing"),
    ({"weight_sync": {"kind": "host", "timeout_s": 5}}, "weight_sync.timeout_s: unknown key (weight_sync.kind=host)"),
    ({"weight_sync": {"kind": "broadcast", "timeout_s": 0}}, "weight_sync.timeout_s"),
    ({"rollout": {"weight_transport": "file"}}, "rollout.weight_transport: replaced by the weight_sync section"),
    ({"placement": {"adapter_route": "host"}}, "placement.adapter_route: replaced by the weight_sync section"),
])
def test_bad_config_names_field(raw, needle):
    with pytest.raises(NlaInputError) as exc:
        build_config(raw, "my.yaml")
    msg = str(exc.value)
    assert msg.startswith("my.yaml: ") and needle in msg and "\n" not in msg


def test_weight_sync_variants_and_overrides():
    cfg = build_config({"weight_sync": {"kind": "file", "directory": "/tmp/adapters"}}, "c")
    assert cfg.weight_sync.kind == "file" and cfg.weight_sync.directory == "/tmp/adapters"
    cfg = build_config({}, "c", ["placement.mode=cpu", "weight_sync.kind=broadcast", "weight_sync.timeout_s=30"])
    assert cfg.weight_sync.kind == "broadcast" and cfg.weight_sync.timeout_s == 30
    assert build_config(yaml.safe_load(dump_config(cfg)), "again") == cfg  # the resolved variant round-trips
    assert "weight_sync.timeout_s" in field_docs() and "weight_sync.directory" in field_docs()


def test_a_saved_config_from_before_weight_sync_resumes_as_it_ran():
    from nla_grpo.shared.config import upgrade_saved_config

    old = yaml.safe_load(dump_config(RunConfig()))
    old.pop("weight_sync")
    for (transport, route, mode), kind in {("memory", "auto", "colocated"): "cuda_ipc", ("memory", "auto", "split"): "broadcast",
                                           ("memory", "collective", "cpu"): "broadcast", ("memory", "host", "split"): "host",
                                           ("file", "auto", "cpu"): "file", ("memory", "auto", "cpu"): "host"}.items():
        raw = {**old, "rollout": {**old["rollout"], "weight_transport": transport},
               "placement": {**old["placement"], "mode": mode, "adapter_route": route},
               "critic": {**old["critic"], "lora_r": 8}}
        assert build_config(upgrade_saved_config(raw), "saved").weight_sync.kind == kind, (transport, route, mode)
    assert "adapter_route" in raw["placement"]  # the caller's mapping is left as it was


def test_bad_override_and_files(tmp_path):
    with pytest.raises(NlaInputError, match="expected key=value"):
        build_config({}, "c", ["grpo.steps"])
    with pytest.raises(NlaInputError, match="rollout.max_new_tokens"):
        build_config({}, "c", ["rollout.max_new_tokens=0"])
    with pytest.raises(NlaInputError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [unclosed")
    with pytest.raises(NlaInputError, match="not valid YAML"):
        load_config(bad)
    assert RunConfig().rollout.temperature == 1.0
    assert yaml.safe_load(dump_config(RunConfig()))["grpo"]["kl_beta"] == 0.04


@pytest.mark.parametrize("raw,needle", [
    ({"model": {"quantization": "nf4"}}, "model.quantization=nf4: bitsandbytes NF4 needs CUDA GPUs"),
    ({"data": {"eval_skip_rows": 10}}, "data: eval_skip_rows=10 needs max_rows at most that (found None)"),
    ({"data": {"eval_skip_rows": 10, "max_rows": 11}}, "the training rows must lie before the eval rows"),
    ({"rollout": {"sleep_during_update": True}}, "rollout.sleep_during_update needs placement.mode=colocated"),
    ({"placement": {"mode": "split"}, "model": {"dtype": "float32"}}, "model.dtype=float32 with the vLLM rollout"),
    ({"placement": {"mode": "split", "learner_gpus": 2}}, "placement.learner_gpus: expected 1"),
    ({"placement": {"mode": "colocated"}, "critic": {"lora_r": 8}, "rollout": {"num_engines": 5}}, "rollout.num_engines at most 4"),
    ({"placement": {"mode": "colocated"}, "model": {"quantization": "nf4", "dtype": "float32"}, "rollout": {"backend": "hf"}},
     "model.quantization=nf4 with model.dtype=float32"),
    ({"placement": {"mode": "colocated"}, "model": {"quantization": "nf4"}, "critic": {"train": True, "lora_r": 0, "checkpoint": "x"}},
     "NF4 weights cannot be trained; give the critic a LoRA"),
    ({"rollout": {"engine_options": {"quantization": "fp8", "max_num_batched_tokens": 64}}},
     "rollout.engine_options: quantization must come from the model section"),
])
def test_rules_across_fields_are_refused_by_the_schema_itself(raw, needle):
    # no model, data or tokenizer behind these paths: the schema alone refuses what training would
    with pytest.raises(NlaInputError) as exc:
        build_config(raw, "my.yaml")
    assert str(exc.value).startswith("my.yaml: ") and needle in str(exc.value)


def test_learner_gpus_zero_is_only_wrong_where_it_is_used():
    assert build_config({"placement": {"mode": "cpu", "learner_gpus": 0}}, "c").placement.learner_gpus == 0
    with pytest.raises(NlaInputError, match="placement.learner_gpus: expected 1"):
        build_config({"placement": {"mode": "cpu", "learner_gpus": 2}}, "c")


def test_quantization_one_field_for_every_service_and_the_older_key_still_reads():
    from nla_grpo.shared.config import upgrade_saved_config
    from nla_grpo.shared.quantization import vllm_options

    gpu = {"placement": {"mode": "colocated"}, "critic": {"lora_r": 8}}
    cfg = build_config({**gpu, "model": {"quantization": "nf4"}}, "c")
    assert cfg.model.quantization == "nf4" and vllm_options(cfg.model.quantization) == {"quantization": "bitsandbytes"}
    assert vllm_options(build_config({}, "c").model.quantization) == {}
    with pytest.warns(FutureWarning, match="model.load_in_4bit is deprecated: use model.quantization"):
        assert build_config({**gpu, "model": {"load_in_4bit": True}}, "c").model.quantization == "nf4"
    with pytest.warns(FutureWarning):
        assert build_config({"model": {"load_in_4bit": False}}, "c").model.quantization == "none"
    with pytest.raises(NlaInputError, match="load_in_4bit: true contradicts quantization: none"):
        build_config({**gpu, "model": {"load_in_4bit": True, "quantization": "none"}}, "c")
    # a run directory saved with the older key resumes as it ran, without the warning
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        saved = upgrade_saved_config({"model": {"load_in_4bit": False, "path": "m"}})
        assert build_config(saved, "c").model.quantization == "none"


def test_enable_thinking_is_unset_by_default_and_old_runs_keep_false():
    from nla_grpo.shared.config import upgrade_saved_config

    assert build_config({}, "c").prompts.enable_thinking is None
    assert build_config({"prompts": {"enable_thinking": "unset"}}, "c").prompts.enable_thinking is None
    assert build_config({"prompts": {"enable_thinking": False}}, "c").prompts.enable_thinking is False
    with pytest.raises(NlaInputError, match="prompts.enable_thinking"):
        build_config({"prompts": {"enable_thinking": "maybe"}}, "c")
    # a run saved before the section rendered with enable_thinking=False, and resumes so
    assert build_config(upgrade_saved_config({"model": {"path": "m"}}), "c").prompts.enable_thinking is False
    assert load_config(ROOT / "deploy/tiny.yaml").prompts.enable_thinking is False  # the demo renders as it did

"""The rules across fields (``shared.config.CROSS_FIELD_RULES``): each breaks on its own case and on no
other rule's, and a config breaking several is refused with every problem, a line each."""
import pytest

from conftest import ROOT, run_cli
from nla_grpo.shared.config import CROSS_FIELD_RULES, RunConfig, build_config
from nla_grpo.shared.errors import NlaInputError

GPU = {"placement": {"mode": "colocated"}, "model": {"dtype": "bfloat16"}}


def _with(base: dict, **sections) -> dict:
    out = {k: dict(v) for k, v in base.items()}
    for section, values in sections.items():
        out.setdefault(section, {}).update(values)
    return out


# one config per rule that breaks that rule alone
CASES = {
    "evals_run_on_eval_steps": {"evals": {"hallucination": {"enabled": True}, "judge": {"model": "judge"}},
                                "logging": {"eval_every": 0}},
    "nf4_needs_gpus": {"model": {"quantization": "nf4"}},
    "liger_kernels_need_gpus": {"learner": {"kernels": "liger"}},
    "flex_attention_needs_gpus_and_packed_rows": {"learner": {"attention": "flex"}},
    "varlen_attention_runs_packed_16_bit_rows": _with(GPU, model={"dtype": "float32"}, rollout={"backend": "hf"},
                                                     learner={"attention": "varlen"}),
    "nf4_computes_in_16_bits": _with(GPU, model={"quantization": "nf4", "dtype": "float32"}, rollout={"backend": "hf"}),
    "nf4_critic_trains_a_lora": _with(GPU, model={"quantization": "nf4"}, critic={"train": True, "lora_r": 0}),
    "engine_base_comes_from_the_model_section": {"rollout": {"engine_options": {"dtype": "half"}}},
    "vllm_on_gpus_computes_in_16_bits": _with(GPU, model={"dtype": "float32"}),
    "sleep_needs_a_shared_gpu": {"rollout": {"sleep_during_update": True}},
    "own_process_is_vllms": {"rollout": {"backend": "hf", "engine_core": "own_process"}},
    "multimodal_vector_input_is_vllms": {"rollout": {"backend": "hf", "vector_input": "multimodal"}},
    "merged_needs_one_vllm_engine_per_gpu": {"rollout": {"backend": "hf", "lora": "merged"}},
    "vllm_takes_the_adapter_rank": {"learner": {"lora_r": 1024}},
    "overlap_takes_one_epoch": {"grpo": {"overlap_rollout": True}, "learner": {"ppo_epochs": 2}},
    "overlap_or_sleep": _with(GPU, grpo={"overlap_rollout": True}, rollout={"sleep_during_update": True}),
    "weight_sync_fits_the_placement": {"rollout": {"backend": "hf"}, "weight_sync": {"kind": "file"}},
    "full_critic_training_needs_fp32": _with(GPU, critic={"train": True, "lora_r": 0}),
    "one_gpu_per_learner_rank": {"placement": {"learner_gpus": 2}},
    "tensor_parallel_is_vllms_on_gpus": {"rollout": {"tensor_parallel_size": 2}},
    "colocated_runs_one_learner_and_one_critic": _with(GPU, placement={"mode": "colocated", "learner_workers": 2}),
    "critic_ranks_share_learner_gpus": _with(GPU, placement={"mode": "split", "critic_workers": 2}),
    "every_learner_rank_gets_a_sample": {"placement": {"learner_workers": 3}, "grpo": {"prompts_per_step": 1},
                                         "rollout": {"group_size": 2}},
    "critic_own_gpu_needs_split": {"placement": {"critic_own_gpu": True}},
    "colocated_engines_fit_the_gpu": _with(GPU, rollout={"num_engines": 5}),
}


def test_every_rule_has_its_case():
    assert set(CASES) == {rule.__name__ for rule in CROSS_FIELD_RULES}


@pytest.mark.parametrize("name", list(CASES))
def test_each_rule_breaks_alone_and_is_refused_in_one_line(name):
    cfg = RunConfig.model_validate(CASES[name], context={"rules": False})
    broken = {rule.__name__: rule(cfg) for rule in CROSS_FIELD_RULES if rule(cfg)}
    assert list(broken) == [name]
    with pytest.raises(NlaInputError) as err:
        build_config(CASES[name], "job.yaml")
    assert str(err.value) == f"job.yaml: {broken[name]}"


def test_the_default_config_breaks_no_rule():
    cfg = RunConfig.model_validate({}, context={"rules": False})
    assert [rule.__name__ for rule in CROSS_FIELD_RULES if rule(cfg)] == []


THREE = {"rollout": {"sleep_during_update": True, "engine_options": {"dtype": "half"}},
         "placement": {"critic_own_gpu": True}}


def test_several_broken_rules_are_reported_together():
    with pytest.raises(NlaInputError) as err:
        build_config(THREE, "job.yaml")
    lines = str(err.value).splitlines()
    assert len(lines) == 3 and all(line.startswith("job.yaml: ") for line in lines)
    assert [l.split(": ")[1].split(" ")[0] for l in lines] == ["rollout.engine_options", "rollout.sleep_during_update",
                                                               "placement.critic_own_gpu"]


def test_config_check_prints_every_problem_a_line_each(tmp_path):
    import yaml

    bad = tmp_path / "three.yaml"
    bad.write_text(yaml.safe_dump(THREE))
    res = run_cli("config", "check", bad)
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert res.returncode == 2 and res.stdout == "" and len(lines) == 3, res.stderr
    assert all(l.startswith(f"nla-grpo: error: {bad}: ") for l in lines)
    # fields that fail on their own are reported together as well
    fields = run_cli("config", "check", ROOT / "deploy/tiny.yaml", "--set", "grpo.steps=0", "--set", "learner.lrr=1",
                     "--set", "rollout.group_size=1")
    lines = [l for l in fields.stderr.splitlines() if l.strip()]
    assert fields.returncode == 2 and len(lines) == 3, fields.stderr
    assert {l.split(": ")[3] for l in lines} == {"grpo.steps", "learner.lrr", "rollout.group_size"}


@pytest.mark.parametrize("change,needle", [
    ({"placement": {"mode": "colocated", "learner_gpus": 0}}, "placement.learner_gpus: expected 1"),
    ({"placement": {"mode": "split", "learner_gpus": 0}}, "placement.learner_gpus: expected 1"),
    ({"placement": {"mode": "split"}, "rollout": {"backend": "hf", "tensor_parallel_size": 2}},
     "rollout.tensor_parallel_size=2 with rollout.backend=hf"),
])
def test_placement_settings_that_would_be_ignored_are_refused(change, needle):
    raw = _with(GPU, **change)
    with pytest.raises(NlaInputError, match=needle):
        build_config(raw)
    assert build_config({"placement": {"learner_gpus": 0}}).placement.learner_gpus == 0  # the CPU needs no GPU


@pytest.mark.parametrize("raw,needle", [
    (_with(GPU, weight_sync={"kind": "broadcast"}), "weight_sync.kind=broadcast with placement.mode=colocated"),
    ({"weight_sync": {"kind": "cuda_ipc"}}, "weight_sync.kind=cuda_ipc needs placement.mode=colocated"),
    ({"rollout": {"backend": "hf"}, "weight_sync": {"kind": "file"}}, "weight_sync.kind=file is how vLLM loads"),
])
def test_each_weight_sync_variant_is_refused_where_it_cannot_run(raw, needle):
    with pytest.raises(NlaInputError, match=needle):
        build_config(raw)
    for ok in ({"weight_sync": {"kind": "host"}}, _with(GPU, weight_sync={"kind": "cuda_ipc"}), {"weight_sync": {"kind": "file"}}):
        build_config(ok)


FIXED = {"micro_batch": 16}  # a fixed learner micro-batch: no budget to measure, the batch decides


@pytest.mark.parametrize("raw, sleeps", [
    (_with(GPU, grpo={"prompts_per_step": 128}, rollout={"group_size": 8}), True),     # 1,024 samples: pays (H200)
    (_with(GPU, grpo={"prompts_per_step": 64}, rollout={"group_size": 8}), "auto"),    # decided at start, measured
    (_with(GPU, grpo={"prompts_per_step": 64}, rollout={"group_size": 8, "num_engines": 2}), True),  # two copies
    (_with(GPU, grpo={"prompts_per_step": 128}, rollout={"group_size": 8}, learner=FIXED), True),   # 1,024 samples
    (_with(GPU, grpo={"prompts_per_step": 64}, rollout={"group_size": 8}, learner=FIXED), False),   # 512: about even
    (_with(GPU, grpo={"prompts_per_step": 64}, rollout={"group_size": 8, "num_engines": 2}, learner=FIXED), True),
    ({"grpo": {"prompts_per_step": 64}, "rollout": {"group_size": 8, "num_engines": 2}}, False),  # CPU engines
    (_with(GPU, grpo={"prompts_per_step": 128, "overlap_rollout": True}, rollout={"group_size": 8}), False),
    (_with(GPU, grpo={"prompts_per_step": 128}, rollout={"group_size": 8, "backend": "hf"}), False),
    ({"grpo": {"prompts_per_step": 128}, "rollout": {"group_size": 8}}, False),        # the CPU placement
    (_with(GPU, grpo={"prompts_per_step": 8}, rollout={"group_size": 8, "sleep_during_update": True}), True),
    (_with(GPU, grpo={"prompts_per_step": 128}, rollout={"group_size": 8, "sleep_during_update": False}), False),
])
def test_sleep_during_update_auto_is_left_to_the_start_only_where_the_batch_does_not_decide(raw, sleeps):
    assert RunConfig.model_validate(raw).rollout.sleep_during_update == sleeps
    assert type(RunConfig.model_validate(raw).rollout.sleep_during_update) is type(sleeps)


@pytest.mark.parametrize("awake, kept, sleeps", [
    (512, None, True),      # an H100's 64 x 8 with the engine awake: the budget's floor (RESULTS.md §15)
    (4096, None, True),     # an H200's 128 x 8 awake: two groups
    (4800, None, False),    # exactly four groups' responses (4 x 8 x 150)
    (9216, None, False),    # an H200's 64 x 8 awake: six groups, fastest awake
    (9216, 14336, True),    # a resumed run keeps the budget it planned asleep: awake it would not fit
    (9216, 9216, False),
])
def test_sleep_auto_sleeps_when_the_awake_micro_batch_is_small(awake, kept, sleeps):
    from nla_grpo.shared.resolve import sleep_for_budget as sleep_pays_for_budget

    cfg = RunConfig.model_validate(_with(GPU, grpo={"prompts_per_step": 64}, rollout={"group_size": 8, "max_new_tokens": 150}))
    assert sleep_pays_for_budget(cfg, awake, kept) is sleeps
    # nothing to sleep for where sleeping cannot pay, whatever the budget
    split = RunConfig.model_validate(_with(GPU, grpo={"prompts_per_step": 64, "overlap_rollout": True}))
    assert sleep_pays_for_budget(split, awake, kept) is False
    # where the batch rule was measured to pay (an H200 at 128 x 8), a roomy budget does not undo it
    big = RunConfig.model_validate(_with(GPU, grpo={"prompts_per_step": 128}, rollout={"group_size": 8}))
    assert sleep_pays_for_budget(big, awake, kept) is True


def test_sleep_auto_without_a_budget_falls_back_to_the_batch():
    from nla_grpo.shared.resolve import sleep_for_budget as sleep_pays_for_budget

    big = RunConfig.model_validate(_with(GPU, grpo={"prompts_per_step": 128}, rollout={"group_size": 8}))
    small = RunConfig.model_validate(_with(GPU, grpo={"prompts_per_step": 64}, rollout={"group_size": 8}))
    assert sleep_pays_for_budget(big, None) is True and sleep_pays_for_budget(small, None) is False


class _Learner:
    def __init__(self, awake, kept):
        self.answer = (awake, kept)

    def planned_tokens(self):
        return self.answer


@pytest.mark.parametrize("awake, kept, sleeps, says", [
    (512, None, True, "would hold 512 tokens (under 4 groups' responses, 4,800): the engines sleep"),
    (9216, None, False, "would hold 9,216 tokens (at least 4 groups' responses, 4,800): the engines stay awake"),
    (9216, 14336, True, "would hold 9,216 tokens (less than the 14,336 it keeps): the engines sleep"),
    (None, None, False, "fixed micro-batch: the engines stay awake"),
])
def test_the_driver_decides_sleep_auto_from_the_learners_budget_and_says_why(awake, kept, sleeps, says):
    from nla_grpo.orchestrator.driver import resolve_sleep

    cfg = RunConfig.model_validate(_with(GPU, grpo={"prompts_per_step": 64}, rollout={"group_size": 8, "max_new_tokens": 150}))
    lines = []
    assert resolve_sleep(cfg, _Learner(awake, kept), lines.append) is sleeps
    assert len(lines) == 1 and lines[0].startswith("[sleep] auto") and says in lines[0]

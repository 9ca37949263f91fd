"""The colocated memory plan (orchestrator.memory_budget): what each service holds, what each phase of a step adds on
either rollout.lora route, the KV cache sized against the fullest awake phase, and the one-line refusal."""
import json
import types

import pytest

from conftest import run_cli
from nla_grpo.orchestrator.memory_budget import (ADAPTER_PARAM_BYTES, ADAM_STATE_BYTES, CONTEXT_BYTES, ENGINE_ASLEEP_BYTES,
                                        FREE_MARGIN, GIB, LORA_ENGINE_BYTES, PHASES, TRAINED_PARAM_BYTES, awake_beside_engines,
                                        awake_update_bytes, beside_colocated_engines, colocated_residents,
                                        critic_forward_bytes, largest_weight_bytes, learner_bytes_per_token,
                                        phase_table, plan_colocated, push_bytes, residents)
from nla_grpo.shared.model_facts import NF4_SHARE, bf16_bytes, lora_params
from nla_grpo.shared.config import build_config
from nla_grpo.shared.errors import NlaInputError

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
H100, H200 = int(79.19 * GIB), int(139.8 * GIB)  # what CUDA reports of an 80 GB H100 and a 141 GB H200
QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
                intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                torch_dtype="bfloat16")


def meta(**fields):
    return types.SimpleNamespace(**fields)


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory):
    """The Qwen3-8B shape as the plan reads it: its config.json and a weights file of its bf16 size (sparse: no disk)."""
    d = tmp_path_factory.mktemp("qwen3-8b")
    (d / "config.json").write_text(json.dumps(QWEN3_8B))
    h, i, L, V = 4096, 12288, 36, 151936
    params = 2 * V * h + L * (2 * h * 4096 + 2 * h * 1024 + 3 * h * i + 2 * h + 2 * 128) + h
    with open(d / "model.safetensors", "wb") as f:
        f.truncate(2 * params)
    return d


def job(model_dir, prompts=64, **rollout):
    """The 64 x 8 job of the benchmarks at the 8B shape, colocated (``rollout.lora`` as given, else auto)."""
    return build_config({"model": {"path": str(model_dir), "dtype": "bfloat16"}, "placement": {"mode": "colocated"},
                         "rollout": {"group_size": 8, "max_new_tokens": 150, "max_prompt_tokens": 256, **rollout},
                         "grpo": {"prompts_per_step": prompts}, "critic": {"num_layers": 25, "micro_batch": 16},
                         "learner": {"lora_r": 128, "lora_alpha": 16}})


SPEC_8B = types.SimpleNamespace(layer_index=24, d_model=4096)


def test_the_residents_count_what_each_service_holds(tiny_dir, tmp_path):
    """lora_params matches PEFT's count on the tiny model; the learner holds its base, the adapter with AdamW state and
    the frozen reference copy; the critic its blocks and what it trains; the engine, on the adapter route only, its
    LoRA slots and the registered version."""
    import shutil

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = tiny_dir / "model"
    c = json.loads((path / "config.json").read_text())

    def cfg(**sections):
        return build_config({"model": {"path": str(path)}, "placement": {"mode": "colocated"}, **sections})

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=4, target_modules=TARGETS))
    assert lora_params(path, 4, TARGETS) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    layers, files = c["num_hidden_layers"], sum(f.stat().st_size for f in path.glob("*.safetensors"))
    stored32 = str(c.get("torch_dtype", c.get("dtype"))) == "float32"
    assert bf16_bytes(path) == (files // 2 if stored32 else files)
    # the same weights stored in the other precision count the same at two bytes each
    other = tmp_path / "other"
    shutil.copytree(path, other)
    (other / "config.json").write_text(json.dumps({**c, "torch_dtype": "bfloat16" if stored32 else "float32"}))
    assert bf16_bytes(other) == (files if stored32 else files // 2)
    (other / "config.json").write_text(json.dumps({**c, "quantization_config": {"load_in_4bit": True}}))
    assert bf16_bytes(other) == int(files / NF4_SHARE)

    base, adapter = bf16_bytes(path), (128, TARGETS)
    params = lora_params(path, 128, TARGETS)
    learner = base + params * (TRAINED_PARAM_BYTES + ADAPTER_PARAM_BYTES) + CONTEXT_BYTES
    whole = residents(cfg(rollout={"lora": "merged"}), 2, adapter)
    assert whole.learner == pytest.approx(learner, abs=4)
    assert whole.critic == pytest.approx(base + CONTEXT_BYTES, abs=4)  # a full-depth frozen critic
    assert whole.engine_lora == 0 and whole.adapter_fp32 == 4 * params and whole.adapter_engine == 2 * params
    # the adapter route: max_loras slots at vLLM's rank and the version registered, in 16 bits
    two = residents(cfg(rollout={"lora": "adapter", "max_loras": 2}), 2, adapter)
    assert two.engine_lora == (2 * params + params) * LORA_ENGINE_BYTES
    assert residents(cfg(rollout={"lora": "adapter"}), 2, adapter).engine_lora == 2 * params * LORA_ENGINE_BYTES
    one = meta(num_layers=1, lora_r=0, target_modules=[])
    assert residents(cfg(), 2, adapter, one).critic == pytest.approx(base / layers + CONTEXT_BYTES, abs=4)
    nf4 = residents(cfg(model={"path": str(path), "quantization": "nf4"}), 2, adapter)
    assert nf4.learner == pytest.approx(learner - base + NF4_SHARE * base, abs=4)
    assert residents(cfg(), 4, adapter).learner == pytest.approx(learner + base, abs=4)  # fp32 weights
    # what the critic trains: its checkpoint's rank and modules, or every weight of its blocks
    lora = meta(num_layers=layers, lora_r=4, target_modules=["q_proj"])
    trained = cfg(critic={"train": True, "checkpoint": "ar"})
    assert residents(trained, 2, adapter, lora).critic == pytest.approx(
        base + CONTEXT_BYTES + lora_params(path, 4, ["q_proj"]) * TRAINED_PARAM_BYTES, abs=4)
    full = meta(num_layers=layers, lora_r=0, target_modules=[])
    assert residents(trained, 2, adapter, full).critic == pytest.approx(base + CONTEXT_BYTES + base / 2 * (2 + ADAM_STATE_BYTES), abs=4)
    # engines that cannot sleep through the update leave the learner room for its smallest awake micro-batch
    assert awake_update_bytes(cfg(), 2) == 0
    awake = cfg(rollout={"sleep_during_update": False})
    assert awake_update_bytes(awake, 2) > 0
    res = residents(awake, 2, adapter)
    assert awake_beside_engines(awake, 2, res) >= res.at_rest + awake_update_bytes(awake, 2)
    # what placement passes the engines: the critic as the sidecar makes it (its layer, a frozen critic)
    from nla_grpo.shared.spec import load_spec, sidecar_path

    spec = load_spec(sidecar_path(tiny_dir / "rl.parquet"))
    run = cfg(model={"path": str(path), "dtype": "bfloat16"})
    res, elem = colocated_residents(run, spec)
    assert elem == 2 and res == residents(run, 2, adapter, meta(num_layers=spec.layer_index + 1, lora_r=0, target_modules=[]))
    assert beside_colocated_engines(run, spec) == awake_beside_engines(run, 2, res)


def test_each_phase_adds_what_it_holds_on_either_route(qwen3_8b):
    """The push holds the learner's export buffer and each engine's received fp32 copy, and the next version built
    beside the registered one (adapter) or one weight's fp32 delta (merged); the engines' plan leaves room for the
    fullest awake phase; asleep, an engine keeps its context and graphs (and its registered adapter)."""
    for route in ("adapter", "merged"):
        cfg = job(qwen3_8b, lora=route)
        res = residents(cfg, 2, (128, TARGETS))
        fp32 = res.adapter_fp32
        assert fp32 == lora_params(qwen3_8b, 128, TARGETS) * 4 > GIB  # 1.3 GiB at rank 128 on the 8B shape
        extra = res.adapter_engine if route == "adapter" else largest_weight_bytes(cfg)
        assert push_bytes(cfg, res) == 2 * fp32 + extra
        engine = 30 * GIB
        table = phase_table(cfg, 2, res, engine, H100, sleeps=True, update_bytes=5 * GIB)
        assert tuple(table) == PHASES
        awake = res.learner + res.critic + engine + res.engine_lora
        assert sum(table["rollout"].values()) == sum(table["checkpoint"].values()) == awake
        assert sum(table["score"].values()) == awake + critic_forward_bytes(cfg, 2)
        assert sum(table["push"].values()) == awake + push_bytes(cfg, res)
        asleep = ENGINE_ASLEEP_BYTES + (res.adapter_engine if route == "adapter" else 0)
        # two 16-bit adapter casts and three chunks of fp32 logits, each at most 1 GiB or the micro-batch's rows
        rows = 5 * GIB // learner_bytes_per_token(cfg, 2)
        transients = 2 * lora_params(qwen3_8b, 128, TARGETS) * 2 + 3 * min(rows * 151936 * 4, GIB)
        assert table["update"]["learner casts + logit chunks"] == transients
        assert sum(table["update"].values()) == res.learner + res.critic + asleep + transients + 5 * GIB
        assert awake_beside_engines(cfg, 2, res) == res.at_rest + res.engine_lora + push_bytes(cfg, res)


def test_the_update_plans_its_micro_batch_in_what_the_learner_leaves_after_its_transients(qwen3_8b):
    """``learner.micro_batch: auto`` sizes its micro-batch in the free memory less the adapter casts and logit chunks
    (``learner.micro_batches.plan_budget``): the plan does the same, so its update row is the activations of that
    micro-batch plus the transients, not a larger micro-batch planned in all the free memory."""
    from nla_grpo.learner.memory_plan import safety, token_budget

    cfg = job(qwen3_8b, lora="merged")
    res = residents(cfg, 2, (128, TARGETS))
    table = phase_table(cfg, 2, res, 30 * GIB, H100, sleeps=True)
    transients = table["update"]["learner casts + logit chunks"]
    held = sum(v for k, v in table["update"].items() if k not in ("learner casts + logit chunks", "learner micro-batch"))
    per_token = learner_bytes_per_token(cfg, 2)
    assert transients == 2 * lora_params(qwen3_8b, 128, TARGETS) * 2 + 3 * GIB
    tokens = token_budget(H100 - held - transients, per_token, 0, safety(True, "varlen"))
    assert table["update"]["learner micro-batch"] == tokens * per_token
    assert tokens < token_budget(H100 - held, per_token, 0, safety(True, "varlen"))  # the reserve costs tokens
    # a micro-batch of few rows holds chunks of its own rows only: 600 tokens x 152k vocabulary x fp32 each
    small = phase_table(cfg, 2, res, 30 * GIB, H100, sleeps=True, update_bytes=600 * per_token)
    assert small["update"]["learner casts + logit chunks"] == 2 * lora_params(qwen3_8b, 128, TARGETS) * 2 + 3 * 600 * 151936 * 4


def test_the_adapter_route_plans_its_lora_memory_into_the_kv_cache(qwen3_8b):
    """At 64 x 8 on an 80 GB card the adapter route's KV cache is smaller than the merged one's by what the adapter
    route holds more while awake (the engine's slots and registered version, the next version in the push): the
    cause of the out-of-memory in the push, where the plan counted neither."""
    adapter, merged = (plan_colocated(job(qwen3_8b, lora=r), SPEC_8B, H100) for r in ("adapter", "merged"))
    cfg = job(qwen3_8b, lora="adapter")
    res = residents(cfg, 2, (128, TARGETS))
    more = res.engine_lora + res.adapter_engine - largest_weight_bytes(cfg)
    gap = merged.engine_kwargs["kv_cache_memory_bytes"] - adapter.engine_kwargs["kv_cache_memory_bytes"]
    assert gap == pytest.approx(more, abs=1 << 20) and gap > GIB


@pytest.mark.parametrize("total,prompts", [(H100, 64), (H100, 128), (H200, 64), (H200, 128), (H200, 256)],
                         ids=["h100-64x8", "h100-128x8", "h200-64x8", "h200-128x8", "h200-256x8"])
def test_every_phase_leaves_three_gib_on_both_routes(qwen3_8b, total, prompts):
    """The batches users run fit on both routes with at least FREE_MARGIN free in every phase, the KV cache holding
    one step (or at 128 x 8 on an 80 GB card, waves of whole groups)."""
    for route in ("adapter", "merged"):
        plan = plan_colocated(job(qwen3_8b, prompts=prompts, lora=route), SPEC_8B, total)
        for phase, items in plan.table.items():
            assert total - sum(items.values()) >= FREE_MARGIN, (route, phase)
        assert plan.engine_kwargs["max_num_seqs"] >= (512 if (total, prompts) == (H100, 128) else prompts * 8)
        assert json.loads(json.dumps(plan.as_json()))["phases"]["push"]["total"] <= (total - FREE_MARGIN) / GIB


def test_a_job_that_cannot_fit_is_refused_in_one_line(qwen3_8b):
    """A fixed vLLM share beside the learner and critic, or a card too small for the engine's KV: one line naming the
    phase or the field, raised before any actor starts (placement calls it first)."""
    with pytest.raises(NlaInputError) as e:
        plan_colocated(job(qwen3_8b, gpu_memory_utilization=0.7), SPEC_8B, H100)
    assert "phase would hold" in str(e.value) and "3 GiB must stay free" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(NlaInputError, match="rollout.gpu_memory_utilization"):
        plan_colocated(job(qwen3_8b), SPEC_8B, 48 * GIB)


def test_auto_picks_the_merged_route_where_an_engine_can_merge(tiny_dir):
    """rollout.lora auto: merged for vLLM on a GPU (one GPU per engine, an in-memory push), adapter on the CPU, with
    weight_sync file, tensor parallelism or the HF backend."""
    def route(**sections):
        return build_config({"model": {"path": str(tiny_dir / "model")}, **sections}).rollout.lora

    assert route(placement={"mode": "colocated"}) == "merged"
    assert route(placement={"mode": "split"}) == "merged"
    assert route(placement={"mode": "cpu"}) == "adapter"
    assert route(placement={"mode": "colocated"}, weight_sync={"kind": "file"}) == "adapter"
    assert route(placement={"mode": "split"}, rollout={"tensor_parallel_size": 2}) == "adapter"
    assert route(placement={"mode": "colocated"}, rollout={"backend": "hf"}) == "adapter"
    assert route(placement={"mode": "colocated"}, rollout={"lora": "adapter"}) == "adapter"


def test_config_check_prints_the_memory_plan_without_a_gpu(tiny_dir, tmp_path):
    """`config check --gpu-gib` prints each phase's planned peak for a colocated config; a job that cannot fit, a
    placement without the plan, or a size that is no GPU's: one line, exit 2."""
    import yaml

    base = {"model": {"path": str(tiny_dir / "model"), "dtype": "bfloat16"}, "data": {"parquet": str(tiny_dir / "rl.parquet")},
            "placement": {"mode": "colocated"}, "rollout": {"max_new_tokens": 16}}
    path = tmp_path / "colocated.yaml"
    path.write_text(yaml.safe_dump(base))
    out = run_cli("config", "check", str(path), "--gpu-gib", "16")
    assert out.returncode == 0, out.stderr
    line, ok = out.stdout.strip().splitlines()
    assert ok.startswith("ok: ") and line.startswith("planned GiB of 16.0: rollout ") and "push" in line and "at least" in line
    for extra, expect in ((["--set", "rollout.gpu_memory_utilization=0.9"], "phase would hold"),
                          (["--set", "placement.mode=cpu"], "colocated vLLM run's"),
                          ([], "expected a GPU's memory in GiB")):
        gib = "0.5" if not extra else "16"
        bad = run_cli("config", "check", str(path), "--gpu-gib", gib, *extra)
        assert bad.returncode == 2 and expect in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_what_the_services_hold_once_up_is_set_beside_the_plan():
    from nla_grpo.orchestrator.memory_budget import GIB, held_once_up

    planned = {"phases": {"rollout": {"learner": 12.43, "critic": 4.29, "engines": 40.66, "total": 57.38}}}
    held = {"learner": {"allocated": int(12.5 * GIB), "reserved": int(19.25 * GIB)}, "critic": None}
    table, line = held_once_up(held, planned)
    assert table == {"learner": {"allocated": 12.5, "reserved": 19.25, "planned": 12.43}}
    assert line == "[memory] held by torch once up, GiB: learner 12.5 allocated, 19.2 reserved (planned 12.4)"
    assert held_once_up({"learner": None, "critic": None}, planned) == ({}, None)  # the CPU: nothing to say
    assert "planned" not in held_once_up(held, None)[0]["learner"]  # no plan (split placement): the measure alone

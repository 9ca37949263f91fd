"""The vLLM engine plan (rollout.engine_plan): batch limits, CUDA-graph sizes, KV reservation, from the batch."""
import pytest

from rollout.engine_plan import (COLOCATED_SHARE, ENGINE_OVERHEAD_BYTES, KV_MARGIN, SPLIT_SHARE, capture_sizes,
                                 kv_bytes_per_token,
                                 plan_engine, step_kv_tokens)
from shared.config import build_config

QWEN3_8B_KV = {"layers": 36, "kv_heads": 8, "head_dim": 128, "elem_bytes": 2}
GIB = 1 << 30


def _ro(**rollout):
    return build_config({"rollout": rollout}).rollout


def test_kv_bytes_per_token_of_the_8b_shape():
    assert kv_bytes_per_token(**QWEN3_8B_KV) == 147_456  # 2 (K, V) x 36 x 8 x 128 x 2 bytes


def test_shared_prompt_blocks_are_held_once_per_group():
    # 200-token prompt: 12 full blocks shared, 8 left + 150 new + 1 in each sample's own blocks
    assert step_kv_tokens(64, 8, 200, 150, shared_prefix=True) == 64 * (192 + 8 * 160)
    assert step_kv_tokens(64, 8, 200, 150, shared_prefix=False) == 64 * 8 * 352
    # a prompt of whole blocks keeps nothing of it per sample but the response
    assert step_kv_tokens(1, 4, 32, 15, shared_prefix=True) == 32 + 4 * 16


def test_capture_sizes_reach_the_decode_batch():
    assert capture_sizes(512)[-1] == 512 and 496 in capture_sizes(512)
    big = capture_sizes(2048)
    assert big[-1] == 2048 and big == sorted(set(big)) and 1088 in big and 1040 not in big  # by 64 past 512
    assert capture_sizes(40)[-1] == 48  # rounded up to the stride: a 40-sample batch is graphed
    assert capture_sizes(1000)[-1] == 1024


@pytest.mark.parametrize("prompts,engines,seqs", [(64, 1, 512), (128, 1, 1024), (256, 1, 2048), (3, 1, 32), (64, 2, 256)])
def test_auto_batch_holds_one_steps_samples(prompts, engines, seqs):
    plan = plan_engine(_ro(num_engines=engines), prompts, 200, QWEN3_8B_KV, colocated=True, weight_bytes=16 * GIB,
                       total_bytes=141 * GIB, eager=False)
    assert plan.max_num_seqs == seqs
    assert plan.capture_sizes[-1] >= seqs and plan.max_num_batched_tokens >= seqs


def test_colocated_auto_memory_is_weights_plus_one_steps_kv():
    ro = _ro()
    plan = plan_engine(ro, 128, 200, QWEN3_8B_KV, colocated=True, weight_bytes=16 * GIB, total_bytes=141 * GIB, eager=False)
    kv = int(step_kv_tokens(128, 8, 200, 150, True) * 147_456 * KV_MARGIN)
    assert plan.kv_cache_bytes == kv
    assert plan.gpu_memory_utilization == pytest.approx((16 * GIB + kv + ENGINE_OVERHEAD_BYTES) / (141 * GIB), abs=1e-4)
    # without prefix caching every sample holds its own prompt: more memory
    off = plan_engine(_ro(prefix_caching=False), 128, 200, QWEN3_8B_KV, colocated=True, weight_bytes=16 * GIB,
                      total_bytes=141 * GIB, eager=False)
    assert off.kv_cache_bytes > 1.5 * plan.kv_cache_bytes
    kwargs = plan.engine_kwargs()
    assert kwargs["kv_cache_memory_bytes"] == kv and kwargs["max_num_seqs"] == 1024
    assert kwargs["compilation_config"]["max_cudagraph_capture_size"] == 1024


def test_split_auto_takes_the_gpu_and_set_values_stand():
    split = plan_engine(_ro(), 64, 200, QWEN3_8B_KV, colocated=False, weight_bytes=16 * GIB, total_bytes=141 * GIB, eager=False)
    assert split.kv_cache_bytes is None and split.gpu_memory_utilization == SPLIT_SHARE
    fixed = plan_engine(_ro(gpu_memory_utilization=0.3, max_num_seqs=100), 64, 200, QWEN3_8B_KV, colocated=True,
                        weight_bytes=16 * GIB, total_bytes=141 * GIB, eager=True)
    assert (fixed.max_num_seqs, fixed.gpu_memory_utilization, fixed.kv_cache_bytes, fixed.capture_sizes) == (100, 0.3, None, None)
    assert "compilation_config" not in fixed.engine_kwargs()


def test_bad_values_are_refused():
    from shared.errors import NlaInputError

    for bad in ({"gpu_memory_utilization": "most"}, {"gpu_memory_utilization": 1.5}, {"max_num_seqs": 0},
                {"max_num_seqs": "many"}):
        with pytest.raises(NlaInputError):
            build_config({"rollout": bad})


def test_the_kv_element_follows_the_engines_cache_dtype(tiny_dir):
    """The plan sizes the cache from the model's config: 2 bytes in bf16, 4 in fp32, 1 with an fp8 cache."""
    import json

    import torch
    from rollout.vllm_engine import model_shape

    c = json.loads((tiny_dir / "model" / "config.json").read_text())

    def shape(dtype, **options):
        return model_shape(build_config({"model": {"path": str(tiny_dir / "model")}, "rollout": {"engine_options": options}}), dtype)

    assert shape(torch.bfloat16) == {"layers": c["num_hidden_layers"], "kv_heads": c["num_key_value_heads"],
                                     "head_dim": c["head_dim"], "elem_bytes": 2}
    assert shape(torch.float32)["elem_bytes"] == 4
    assert shape(torch.bfloat16, kv_cache_dtype="fp8")["elem_bytes"] == shape(torch.float32, kv_cache_dtype="fp8_e5m2")["elem_bytes"] == 1
    assert shape(torch.bfloat16, kv_cache_dtype="auto")["elem_bytes"] == 2


def test_the_colocated_kv_gives_way_to_what_the_learner_and_critic_hold():
    """128 x 8 at 8B on an 80 GB card: one step's KV does not fit beside the learner and critic, so the engine gets
    what they leave and admits only the groups whose longest KV fits (waves, not preemption), instead of the learner
    failing to start; on a 141 GB card the same residents leave the whole step's KV and batch."""
    ro, resident = _ro(), 32 * GIB
    h100 = plan_engine(ro, 128, 512, QWEN3_8B_KV, colocated=True, weight_bytes=16 * GIB, total_bytes=79 * GIB,
                       eager=False, resident_bytes=resident, max_model_len=40960)
    needed = step_kv_tokens(128, 8, 512, 150, True) * 147_456
    per_group = step_kv_tokens(1, 8, 512, 150, True) * 147_456
    assert h100.kv_needed_bytes == needed and h100.kv_cache_bytes < needed
    assert 16 * GIB + h100.kv_cache_bytes + ENGINE_OVERHEAD_BYTES + resident <= COLOCATED_SHARE * 79 * GIB + 1
    assert h100.max_num_seqs == h100.kv_cache_bytes // per_group * 8 < 1024 and h100.max_num_seqs % 8 == 0
    assert h100.max_num_seqs * per_group // 8 <= h100.kv_cache_bytes  # every admitted group's longest KV fits
    assert h100.capture_sizes[-1] >= h100.max_num_seqs and h100.capture_sizes[-1] < 1024
    line = h100.shortfall()
    assert f"at most {h100.max_num_seqs} samples at once" in line and "waves" in line
    assert h100.engine_kwargs()["kv_cache_memory_bytes"] == h100.kv_cache_bytes
    h200 = plan_engine(ro, 128, 512, QWEN3_8B_KV, colocated=True, weight_bytes=16 * GIB, total_bytes=141 * GIB,
                       eager=False, resident_bytes=resident, max_model_len=40960)
    assert h200.kv_cache_bytes == int(needed * KV_MARGIN) and h200.shortfall() is None and h200.max_num_seqs == 1024
    # the margin gives way first: room for the step's KV without all of its margin is not a shortfall
    tight = plan_engine(ro, 128, 512, QWEN3_8B_KV, colocated=True, weight_bytes=16 * GIB, total_bytes=141 * GIB,
                        eager=False, resident_bytes=int(COLOCATED_SHARE * 141 * GIB) - 24 * GIB - int(needed * 1.1))
    assert needed < tight.kv_cache_bytes < needed * KV_MARGIN and tight.shortfall() is None and tight.max_num_seqs == 1024
    # engines on one card split what is left: four at 256 x 8 on the 141 GB card get less than a step's KV each
    four = plan_engine(_ro(num_engines=4), 256, 512, QWEN3_8B_KV, colocated=True, weight_bytes=16 * GIB,
                       total_bytes=141 * GIB, eager=False, resident_bytes=resident)
    assert four.kv_cache_bytes < four.kv_needed_bytes
    assert 4 * (16 * GIB + four.kv_cache_bytes + ENGINE_OVERHEAD_BYTES) + resident <= COLOCATED_SHARE * 141 * GIB + 4
    # a max_num_seqs the user set stands
    fixed = plan_engine(_ro(max_num_seqs=512), 128, 512, QWEN3_8B_KV, colocated=True, weight_bytes=16 * GIB,
                        total_bytes=79 * GIB, eager=False, resident_bytes=resident)
    assert fixed.max_num_seqs == 512 and fixed.kv_cache_bytes == h100.kv_cache_bytes


def test_no_room_for_an_engine_is_one_line_naming_the_field():
    from shared.errors import NlaInputError

    with pytest.raises(NlaInputError, match=r"^rollout.gpu_memory_utilization: auto: a 40.0 GiB GPU leaves an engine"):
        plan_engine(_ro(), 64, 512, QWEN3_8B_KV, colocated=True, weight_bytes=16 * GIB, total_bytes=40 * GIB,
                    eager=False, resident_bytes=16 * GIB)
    # room for a group but not for vLLM's longest request (it refuses to start then): refused here, in one line
    args = dict(colocated=True, weight_bytes=16 * GIB, total_bytes=int((24 + 3 + 16) * GIB / COLOCATED_SHARE),
                eager=False, resident_bytes=16 * GIB)
    assert plan_engine(_ro(), 64, 512, QWEN3_8B_KV, **args, max_model_len=4096).kv_cache_bytes <= 3 * GIB + 1
    with pytest.raises(NlaInputError, match=r"max_model_len 40960"):
        plan_engine(_ro(), 64, 512, QWEN3_8B_KV, **args, max_model_len=40960)
    # a step smaller than vLLM's longest request still gets a KV cache that holds one (vLLM checks it at start)
    small = plan_engine(_ro(), 2, 512, QWEN3_8B_KV, colocated=True, weight_bytes=16 * GIB, total_bytes=141 * GIB,
                        eager=False, resident_bytes=32 * GIB, max_model_len=40960)
    assert small.kv_needed_bytes * KV_MARGIN < 40960 * 147_456 == small.kv_cache_bytes


def test_the_residents_estimate_counts_what_each_service_holds(tiny_dir, tmp_path):
    """lora_params matches PEFT's count on the tiny model; the estimate holds the policy's base and the critic's
    blocks in the run's precision (half the files of an fp32-stored checkpoint in bf16), about a third of it in NF4,
    and grows with what the critic trains and with the learner's working memory where the engines stay awake."""
    import json
    import shutil

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from orchestrator.gpu_residents import (ADAM_STATE_BYTES, CONTEXT_BYTES, TRAINED_PARAM_BYTES, awake_update_bytes,
                                            colocated_residents, resident_bytes)
    from rollout.colocated_memory import NF4_SHARE, bf16_bytes, lora_params
    from shared.spec import load_spec, sidecar_path

    path = tiny_dir / "model"
    c = json.loads((path / "config.json").read_text())

    def cfg(**sections):
        return build_config({"model": {"path": str(path)}, "placement": {"mode": "colocated"}, **sections})

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=4, target_modules=targets))
    assert lora_params(cfg(), 4, targets) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    layers, files = c["num_hidden_layers"], sum(f.stat().st_size for f in path.glob("*.safetensors"))
    stored32 = str(c.get("torch_dtype", c.get("dtype"))) == "float32"
    assert bf16_bytes(cfg()) == (files // 2 if stored32 else files)
    # the same weights stored in the other precision count the same at two bytes each
    other = tmp_path / "other"
    shutil.copytree(path, other)
    (other / "config.json").write_text(json.dumps({**c, "torch_dtype": "bfloat16" if stored32 else "float32"}))
    assert bf16_bytes(build_config({"model": {"path": str(other)}})) == (files if stored32 else files // 2)
    # a checkpoint saved in NF4 holds about a third of its bf16 size
    (other / "config.json").write_text(json.dumps({**c, "quantization_config": {"load_in_4bit": True}}))
    assert bf16_bytes(build_config({"model": {"path": str(other)}})) == int(files / NF4_SHARE)

    base, adapter = bf16_bytes(cfg()), (128, targets)
    trained = lora_params(cfg(), 128, targets) * TRAINED_PARAM_BYTES
    whole = resident_bytes(cfg(), 2, adapter)
    assert whole == pytest.approx(2 * base + trained + 2 * CONTEXT_BYTES, abs=4)  # the policy's base, a full-depth critic
    one = types_meta(num_layers=1, lora_r=0, target_modules=[])
    assert resident_bytes(cfg(), 2, adapter, one) == pytest.approx(whole - base * (layers - 1) / layers, abs=4)
    assert resident_bytes(cfg(model={"path": str(path), "quantization": "nf4"}), 2, adapter) == pytest.approx(
        2 * NF4_SHARE * base + trained + 2 * CONTEXT_BYTES, abs=4)
    assert resident_bytes(cfg(), 4, adapter) == pytest.approx(4 * base + trained + 2 * CONTEXT_BYTES, abs=4)  # fp32
    # what the critic trains: its checkpoint's rank and modules, or every weight of its blocks
    lora = types_meta(num_layers=layers, lora_r=4, target_modules=["q_proj"])
    assert resident_bytes(cfg(critic={"train": True, "checkpoint": "ar"}), 2, adapter, lora) == pytest.approx(
        whole + lora_params(cfg(), 4, ["q_proj"]) * TRAINED_PARAM_BYTES, abs=4)
    full = types_meta(num_layers=layers, lora_r=0, target_modules=[])
    assert resident_bytes(cfg(critic={"train": True, "checkpoint": "ar"}), 2, adapter, full) == pytest.approx(
        whole + base / 2 * (2 + ADAM_STATE_BYTES), abs=4)
    # engines that cannot sleep through the update leave the learner room for its smallest awake micro-batch
    assert awake_update_bytes(cfg(), 2) == 0  # auto: they sleep when its room is short
    awake = cfg(rollout={"sleep_during_update": False})
    assert awake_update_bytes(awake, 2) > 0
    # read from config.json before any model loads, the per-token count is the one the learner's planner makes
    from transformers import AutoConfig

    from learner.memory_plan import config_bytes_per_token
    for checkpointing in (True, False):
        assert config_bytes_per_token(c, 128, 2, checkpointing) == config_bytes_per_token(
            AutoConfig.from_pretrained(path), 128, 2, checkpointing) > 0
    assert resident_bytes(awake, 2, adapter) == whole + awake_update_bytes(awake, 2)
    # what placement passes the engines: the critic as the sidecar makes it (its layer, a frozen critic)
    spec = load_spec(sidecar_path(tiny_dir / "rl.parquet"))
    meta = types_meta(num_layers=spec.layer_index + 1, lora_r=0, target_modules=[])
    assert colocated_residents(cfg(model={"path": str(path), "dtype": "bfloat16"}), spec) == resident_bytes(cfg(), 2, adapter, meta)


def types_meta(**fields):
    import types

    return types.SimpleNamespace(**fields)


def test_the_engine_plan_takes_the_residents_on_a_colocated_gpu(tiny_dir, capsys):
    """engine_kwargs on a colocated GPU: the plan leaves the learner and critic what they hold (a card just big enough
    caps the KV and prints the [plan] line); a fixed share plans no residents."""
    import torch

    from rollout.engine_plan import ENGINE_OVERHEAD_BYTES
    from rollout.vllm_engine import engine_kwargs, gpu_plan, weight_bytes

    model = {"path": str(tiny_dir / "model"), "dtype": "bfloat16"}
    cfg = build_config({"model": model, "placement": {"mode": "colocated"}})
    residents = 3 << 30
    whole = gpu_plan(cfg, torch.bfloat16, 1 << 40)
    room = whole.kv_needed_bytes // 2  # KV room for half the step
    total = int((residents + weight_bytes(cfg, torch.bfloat16) + ENGINE_OVERHEAD_BYTES + room) / COLOCATED_SHARE) + 1
    kw = engine_kwargs(cfg, "cuda", torch.bfloat16, marker_id=7, total_bytes=total, resident_bytes=residents)
    assert room - (1 << 20) <= kw["kv_cache_memory_bytes"] <= room + 1
    assert kw["max_num_seqs"] < whole.max_num_seqs and "[plan] one step's KV cache" in capsys.readouterr().out
    fixed = build_config({"model": model, "placement": {"mode": "colocated"}, "rollout": {"gpu_memory_utilization": 0.3}})
    kw = engine_kwargs(fixed, "cuda", torch.bfloat16, marker_id=7, total_bytes=total, resident_bytes=residents)
    assert kw["gpu_memory_utilization"] == 0.3 and "kv_cache_memory_bytes" not in kw

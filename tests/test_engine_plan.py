"""The vLLM engine plan (rollout.engine_plan): batch limits, CUDA-graph sizes, KV reservation, from the batch."""
import pytest

from nla_grpo.rollout.engine_plan import (COLOCATED_SHARE, ENGINE_OVERHEAD_BYTES, KV_MARGIN, SPLIT_SHARE, capture_sizes,
                                 kv_bytes_per_token,
                                 plan_engine, step_kv_tokens)
from nla_grpo.shared.config import build_config

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
    from nla_grpo.shared.errors import NlaInputError

    for bad in ({"gpu_memory_utilization": "most"}, {"gpu_memory_utilization": 1.5}, {"max_num_seqs": 0},
                {"max_num_seqs": "many"}):
        with pytest.raises(NlaInputError):
            build_config({"rollout": bad})


def test_the_kv_element_follows_the_engines_cache_dtype(tiny_dir):
    """The plan sizes the cache from the model's config: 2 bytes in bf16, 4 in fp32, 1 with an fp8 cache."""
    import json

    import torch
    from nla_grpo.rollout.vllm.engine import model_shape

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
    from nla_grpo.shared.errors import NlaInputError

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


def test_the_engine_plan_takes_the_residents_on_a_colocated_gpu(tiny_dir, capsys):
    """engine_kwargs on a colocated GPU: the plan leaves the learner and critic what they hold (a card just big enough
    caps the KV and prints the [plan] line); a fixed share plans no residents."""
    import torch

    from nla_grpo.rollout.engine_plan import ENGINE_OVERHEAD_BYTES
    from nla_grpo.rollout.vllm.engine import engine_kwargs, gpu_plan, weight_bytes

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

"""Rollout bookkeeping shared by both backends: stop set, trimming, finish reason, echo flag, text, weights."""
import json

import pytest
import torch

from nla_grpo.rollout.engine import FINISH_LENGTH, FINISH_STOP, SampleBuilder, sample_seed, stop_token_ids, trim_at_stop
from nla_grpo.shared.errors import NlaInputError
from nla_grpo.shared.schema import extract_explanation
from nla_grpo.shared.spec import load_spec, sidecar_path
from nla_grpo.shared.types import PromptRequest


@pytest.fixture(scope="module")
def tok_spec(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir / "model"), load_spec(sidecar_path(tiny_dir / "rl.parquet"))


def test_stop_ids_are_every_eos_plus_single_token_extras(tiny_dir, tok_spec):
    tok, _ = tok_spec
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(tiny_dir / "model").eos_token_id
    assert isinstance(eos, list) and len(eos) == 2
    ids = stop_token_ids(tiny_dir / "model", tok, ["</explanation>"])
    assert ids == [*eos, tok.convert_tokens_to_ids("</explanation>")]
    with pytest.raises(NlaInputError, match="extra_stop_tokens.*one token id"):
        stop_token_ids(tiny_dir / "model", tok, ["sea wave salt"])


@pytest.mark.parametrize("stop", [0, 1, 2])
def test_trim_at_each_stop_id_inclusive(stop):
    stops = [11, 12, 13]
    ids = [5, 6, stops[stop], 7, stops[(stop + 1) % 3], 8]
    ids_out, lps, finish = trim_at_stop(ids, [-0.1 * (i + 1) for i in range(6)], stops, max_new_tokens=6)
    assert ids_out == [5, 6, stops[stop]] and lps == pytest.approx([-0.1, -0.2, -0.3]) and finish == FINISH_STOP


def test_cap_without_stop_is_length_and_mismatch_raises():
    assert trim_at_stop([1, 2, 3], [-1.0] * 3, [9], max_new_tokens=3) == ([1, 2, 3], [-1.0] * 3, FINISH_LENGTH)
    with pytest.raises(ValueError, match="logprobs"):
        trim_at_stop([1, 2, 3], [-1.0] * 2, [9], 3)


def test_builder_text_echo_and_extraction(tok_spec):
    tok, spec = tok_spec
    prefill = "<explanation>"
    stops = stop_token_ids(spec.path.parent / "model", tok, ["</explanation>"])
    builder = SampleBuilder(tok, spec, stops, prefill, max_new_tokens=12)
    prompt = [1, 50, spec.left_id, spec.marker_id, spec.right_id, 60, 61]
    req = PromptRequest(row_id=3, prompt_ids=prompt, site=3, vector=[0.0])
    body = tok.encode(" sea wave", add_special_tokens=False)
    close = tok.convert_tokens_to_ids("</explanation>")
    s = builder.build(req, 1, body + [close, 99, 98], [-0.5] * (len(body) + 3), adapter_version=4)
    assert s.response_ids == body + [close] and s.finish_reason == FINISH_STOP and s.adapter_version == 4
    assert s.text.startswith(prefill) and extract_explanation(s.text) == "sea wave" and not s.marker_echo
    echo = builder.build(req, 0, body + [spec.left_id, spec.marker_id, spec.right_id], [-0.5] * (len(body) + 3), 4)
    assert echo.marker_echo and echo.finish_reason == FINISH_LENGTH
    # the trigram completed across the prompt/response boundary counts too
    edge = PromptRequest(row_id=3, prompt_ids=prompt[:-2] + [spec.left_id, spec.marker_id], site=3, vector=[0.0])
    assert builder.build(edge, 0, [spec.right_id, 5], [-1.0, -1.0], 4).marker_echo
    assert not builder.build(edge, 0, [5, spec.right_id], [-1.0, -1.0], 4).marker_echo


def test_sample_seed_is_stable_and_spread():
    assert sample_seed(1, 7) == sample_seed(1, 7)
    seeds = {sample_seed(s, r) for s in range(4) for r in range(50)}
    assert len(seeds) == 200 and all(0 <= x < 2**31 for x in seeds)


def test_embed_tokens_single_sharded_and_tied(tiny_dir, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from nla_grpo.rollout.embeddings import load_embed_tokens

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32)
    W = model.get_input_embeddings().weight.detach()
    assert torch.equal(load_embed_tokens(tiny_dir / "model"), W)
    # sharded: the embedding sits in the second shard, found through the index
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    save_file({"model.norm.weight": torch.ones(4)}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"model.embed_tokens.weight": W.clone()}, str(sharded / "model-00002-of-00002.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.norm.weight": "model-00001-of-00002.safetensors",
        "model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}))
    assert torch.equal(load_embed_tokens(sharded, dtype=torch.bfloat16), W.to(torch.bfloat16))
    # tied checkpoint that stores only lm_head
    tied = tmp_path / "tied"
    tied.mkdir()
    (tied / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    save_file({"lm_head.weight": W.clone()}, str(tied / "model.safetensors"))
    assert torch.equal(load_embed_tokens(tied), W)
    (tied / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    with pytest.raises(NlaInputError, match="embed_tokens"):
        load_embed_tokens(tied)


def test_adapter_dir_round_trips_through_peft(tiny_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rollout_support import random_adapter_update
    from nla_grpo.rollout.vllm.adapter_registry import ADAPTER_CONFIG, write_adapter_dir
    from nla_grpo.shared.fileio import jsonable

    update = random_adapter_update(tiny_dir / "model", 1, seed=0, r=8, alpha=16, target_modules=["q_proj", "down_proj"])
    assert isinstance(update.peft_config["target_modules"], set)  # what LoraConfig.to_dict() gives
    cfg = json.loads(json.dumps(jsonable(update.peft_config)))
    assert cfg["target_modules"] == ["down_proj", "q_proj"] and cfg["r"] == 8
    path = write_adapter_dir(update, tmp_path / "a")
    assert json.loads((path / ADAPTER_CONFIG).read_text())["use_rslora"] is True
    base = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(path))
    from peft import get_peft_model_state_dict

    got = get_peft_model_state_dict(loaded)
    assert set(got) == set(update.tensors)
    assert all(torch.equal(got[k], update.tensors[k]) for k in got)


def test_vllm_rank_karvonen_class_and_engine_options(tiny_dir, tmp_path):
    import json
    import shutil

    from nla_grpo.rollout.vllm.engine import engine_kwargs, max_lora_rank_for
    from nla_grpo.shared.config import build_config

    assert [max_lora_rank_for(r) for r in (1, 2, 8, 9, 128, 200)] == [1, 8, 8, 16, 128, 256]
    with pytest.raises(NlaInputError, match="lora_r"):
        max_lora_rank_for(1024)
    model = {"path": str(tiny_dir / "model")}
    # karvonen runs compiled too (the injection is in the model class's forward), selected by hf_overrides
    for mode in ("embed", "karvonen"):
        cfg = build_config({"model": model, "injection": {"mode": mode, "karvonen_layer": 1}, "rollout": {"enforce_eager": False}})
        kw = engine_kwargs(cfg, "cuda", torch.bfloat16, marker_id=7)
        assert kw["enforce_eager"] is False
        assert kw.get("hf_overrides") == (None if mode == "embed" else {
            "architectures": ["NlaKarvonenQwen3ForCausalLM"], "nla_karvonen_layer": 1, "nla_marker_id": 7})
    # NF4 in flight, the learner's base: from model.quantization alone
    nf4 = build_config({"model": {**model, "quantization": "nf4", "dtype": "bfloat16"}, "placement": {"mode": "colocated"},
                        "rollout": {"lora": "adapter"}})  # the merged route (auto, on a GPU) runs the base dequantised
    assert engine_kwargs(nf4, "cuda", torch.bfloat16, marker_id=7)["quantization"] == "bitsandbytes"
    assert "quantization" not in engine_kwargs(build_config({"model": model}), "cuda", torch.bfloat16)
    # sleep auto, colocated: decided at start, after the engine is built, so the engine can sleep; elsewhere it cannot
    assert nf4.rollout.sleep_during_update == "auto" and engine_kwargs(nf4, "cuda", torch.bfloat16, marker_id=7)["enable_sleep_mode"]
    awake = build_config({"model": {**model, "dtype": "bfloat16"}, "placement": {"mode": "colocated"},
                          "rollout": {"sleep_during_update": False}})
    assert "enable_sleep_mode" not in engine_kwargs(awake, "cuda", torch.bfloat16, marker_id=7)
    assert "enable_sleep_mode" not in engine_kwargs(build_config({"model": model}), "cuda", torch.bfloat16)
    # rollout.engine_options come last and win
    cfg = build_config({"model": model, "rollout": {"engine_options": {"enforce_eager": True, "max_num_batched_tokens": 64}}})
    kw = engine_kwargs(cfg, "cuda", torch.bfloat16)
    assert kw["enforce_eager"] is True and kw["max_num_batched_tokens"] == 64
    # an architecture without an injecting class is one line naming the model's config
    other = tmp_path / "model"
    shutil.copytree(tiny_dir / "model", other)
    raw = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**raw, "architectures": ["MistralForCausalLM"]}))
    cfg = build_config({"model": {"path": str(other)}, "injection": {"mode": "karvonen"}})
    with pytest.raises(NlaInputError, match=r"config.json: injection.mode karvonen on vLLM: expected a model of Qwen3ForCausalLM"):
        engine_kwargs(cfg, "cuda", torch.bfloat16, marker_id=7)
    # so is one without a marker-input class; the tiny Qwen3 gets its class and the route's options
    cfg = build_config({"model": {"path": str(other)}, "rollout": {"vector_input": "multimodal"}})
    with pytest.raises(NlaInputError, match=r"config.json: rollout.vector_input multimodal: expected a model of Qwen3"):
        engine_kwargs(cfg, "cuda", torch.bfloat16, marker_id=7)
    kw = engine_kwargs(build_config({"model": model, "rollout": {"vector_input": "multimodal"}}), "cuda", torch.bfloat16,
                       marker_id=7)
    auto = engine_kwargs(build_config({"model": model, "placement": {"mode": "colocated"}}), "cuda", torch.bfloat16,
                         marker_id=7, total_bytes=80 << 30)  # auto takes the route on one GPU
    assert {k: auto[k] for k in ("hf_overrides", "enable_prompt_embeds", "enable_mm_embeds")} == {
        k: kw[k] for k in ("hf_overrides", "enable_prompt_embeds", "enable_mm_embeds")}
    assert kw["hf_overrides"] == {"architectures": ["NlaMarkerInputQwen3ForCausalLM"], "nla_marker_id": 7}
    assert kw["enable_prompt_embeds"] is False and kw["enable_mm_embeds"] is True
    # karvonen mode on the route: its injecting class with the item input on top, and its layer
    kw = engine_kwargs(build_config({"model": model, "injection": {"mode": "karvonen", "karvonen_layer": 1},
                                     "rollout": {"vector_input": "multimodal"}}), "cuda", torch.bfloat16, marker_id=7)
    assert kw["hf_overrides"] == {"architectures": ["NlaMarkerInputNlaKarvonenQwen3ForCausalLM"],
                                  "nla_karvonen_layer": 1, "nla_marker_id": 7}
    assert kw["enable_prompt_embeds"] is False and kw["enable_mm_embeds"] is True


def test_auto_vector_input_takes_the_multimodal_route_only_where_it_has_run_on_a_gpu(tiny_dir, tmp_path):
    import json
    import shutil

    from nla_grpo.shared.resolve import vector_input
    from nla_grpo.shared.config import build_config

    model = {"path": str(tiny_dir / "model")}

    def route(placement="colocated", model=model, **sections):
        return vector_input(build_config({"model": model, "placement": {"mode": placement}, **sections}))

    assert route() == "multimodal"  # the colocated placement, embed mode, a Qwen3 checkpoint
    assert route("split") == "prompt_embeds" and route("cpu") == "prompt_embeds"
    assert route(injection={"mode": "karvonen"}) == "prompt_embeds"
    assert route(rollout={"backend": "hf"}) == "prompt_embeds"
    other = tmp_path / "model"
    shutil.copytree(tiny_dir / "model", other)
    raw = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**raw, "architectures": ["LlamaForCausalLM"]}))
    assert route(model={"path": str(other)}) == "prompt_embeds"  # no marker-input class for it
    # a value set stands wherever it is valid
    assert route(rollout={"vector_input": "prompt_embeds"}) == "prompt_embeds"
    assert route("split", rollout={"vector_input": "multimodal"}) == "multimodal"

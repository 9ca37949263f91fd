"""Importing a reference-trainer checkpoint (``iter_NNNNNN``): the artefacts are built here the reference
trainer's way (PEFT ``save_pretrained`` of the policy with its ``reference`` adapter beside, an AR-LoRA
``critic/``, ``training_state.pt`` by ``torch.save`` of plain types and tensors); the run directory that
``nla-grpo import-run`` writes continues them: its first update is the reference trainer's AdamW step
from the saved moments, and its row order is the reference trainer's."""
import json
import shutil

import numpy as np
import pytest
import torch

from conftest import ROOT, run_cli

ROWS, PROMPTS, STEP, SEED = 64, 16, 4, 0  # 4 steps of 16 prompts use all 64 rows: the next batch reshuffles


def _reference_batches(pending, cursor, rng, steps):
    """The reference trainer's sampling loop, restated: reshuffle the list in place when fewer than a
    batch remain, then read a batch at the cursor."""
    out = []
    for _ in range(steps):
        if cursor + PROMPTS > len(pending):
            rng.shuffle(pending)
            cursor = 0
        out.append(pending[cursor : cursor + PROMPTS])
        cursor += PROMPTS
    return out, cursor


def test_reference_order_continues_the_reference_trainers_order():
    from nla_grpo.shared.data import ReferenceOrder, order_from_state

    ours = ReferenceOrder(ROWS, SEED)
    ref_rng = np.random.default_rng(SEED)
    ref_pending = list(range(ROWS))
    ref_rng.shuffle(ref_pending)
    assert ours.pending == ref_pending  # the same first shuffle from the same seed
    expected, _ = _reference_batches(ref_pending, 0, ref_rng, 9)
    got = []
    for i in range(9):
        if i in (3, 4, 6):  # through JSON and back, before and after a reshuffle
            ours = order_from_state(json.loads(json.dumps(ours.state())))
        got.append(ours.next_batch(PROMPTS))
    assert got == expected and got[4] != got[0]
    with pytest.raises(ValueError, match="not a permutation of the 64 training rows"):
        ReferenceOrder(ROWS, SEED, pending=[0] * ROWS)


def test_the_reference_split_trains_on_the_first_rows_and_evaluates_past_the_skip():
    from nla_grpo.shared.data import RlRows, split_reference

    docs = ["a", "b", "a", "c", "d", "c", "e", "d"]
    rows = RlRows([[{"role": "user", "content": str(i)}] for i in range(8)], np.zeros((8, 2), np.float32), docs,
                  np.arange(8, dtype=np.int64))
    train, ev = split_reference(rows, max_rows=3, eval_skip_rows=4)
    assert train.row_ids.tolist() == [0, 1, 2]
    assert ev.row_ids.tolist() == [4, 6, 7]  # row 5 shares document c with row 3, before the skip


@pytest.fixture(scope="module")
def reference_iter(tiny_dir, tmp_path_factory):
    """``av_sft/`` and ``iter_000004/`` as the reference trainer writes them, after 4 steps."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from test_critic_import_reference import _write_reference

    root = tmp_path_factory.mktemp("reference")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32)
    sft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                          lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in sft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    sft.save_pretrained(root / "av_sft")
    base = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32)
    actor = PeftModel.from_pretrained(base, root / "av_sft", adapter_name="default", is_trainable=True)
    actor.load_adapter(root / "av_sft", adapter_name="reference")
    actor.set_adapter("default")
    for n, p in actor.named_parameters():
        if ".reference." in n:
            p.requires_grad_(False)
    trainable = [p for p in actor.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trainable, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEP):
        for p in trainable:
            p.grad = torch.randn(p.shape, generator=gen) * 0.1
        optim.step()
    it = root / "iter_000004"
    actor.save_pretrained(it)  # the policy at the top, the reference under reference/
    _, ar = _write_reference(root, tiny_dir)
    shutil.copytree(ar, it / "critic")
    rng = np.random.default_rng(SEED)
    pending = list(range(ROWS))
    rng.shuffle(pending)
    _, cursor = _reference_batches(pending, 0, rng, STEP)
    torch.save({"version": 1, "step": STEP, "cursor": cursor, "pending_idxs": pending,
                "numpy_rng_state": rng.bit_generator.state, "torch_rng_state": torch.get_rng_state(),
                "cuda_rng_state_all": None, "actor_optim_state": optim.state_dict(), "critic_optim_state": None},
               it / "training_state.pt")
    names = [n.replace(".default", "") for n, p in actor.named_parameters() if p.requires_grad]
    return {"root": root, "iter": it, "av_sft": root / "av_sft", "names": names, "pending": pending, "cursor": cursor,
            "rng_state": rng.bit_generator.state}


def _config(tiny_dir, path):
    import yaml

    raw = yaml.safe_load((ROOT / "deploy/tiny.yaml").read_text())
    raw["model"]["path"], raw["data"]["parquet"] = str(tiny_dir / "model"), str(tiny_dir / "rl.parquet")
    raw["data"].update(max_rows=ROWS, eval_skip_rows=ROWS)
    raw["critic"].update(train=False, lora_r=None)
    raw["grpo"]["prompts_per_step"] = PROMPTS
    raw["learner"]["lr"] = 3e-3
    raw["seed"] = SEED
    raw["logging"].update(eval_every=0)
    path.write_text(yaml.safe_dump(raw))
    return path


def _reference_step(tiny_dir, reference_iter, samples, vectors, advantages, lr, marker_id, layer=0, clip_eps=0.2,
                    kl_beta=0.04, max_grad_norm=1.0):
    """The reference trainer's GRPO step, restated from its formulas on its own artefacts: a PEFT actor
    from the iter adapter with the AV-SFT adapter as ``reference``; the karvonen add after block
    ``layer`` (h[site] += ||h[site]||·v/||v||); per sample the token mean of
    -(min(r·A, clip(r)·A) - beta·k3(ref, new)), averaged over samples; the gradient clipped; torch AdamW
    loaded from training_state.pt. Returns the policy's LoRA tensors after the step, by PEFT key."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32)
    actor = PeftModel.from_pretrained(base, reference_iter["iter"], adapter_name="default", is_trainable=True)
    actor.load_adapter(reference_iter["av_sft"], adapter_name="reference")
    actor.set_adapter("default")
    trainable = [p for p in actor.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    optim.load_state_dict(torch.load(reference_iter["iter"] / "training_state.pt", weights_only=True)["actor_optim_state"])
    current = {}

    def add(module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        ids, v = current["ids"], current["v"]
        site = int((ids[0] == marker_id).nonzero()[0])
        row = h[0, site]
        h = h.clone()
        h[0, site] = row + row.norm() * v / v.norm()
        return (h, *output[1:]) if isinstance(output, tuple) else h

    handle = actor.base_model.model.model.layers[layer].register_forward_hook(add)
    losses = []
    for s, v, a in zip(samples, vectors, advantages):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        current.update(ids=ids, v=v.float())
        P, T = len(s.prompt_ids), ids.shape[1]
        target = ids[0, P:]
        new = torch.log_softmax(actor(input_ids=ids).logits[0].float(), -1)[P - 1 : T - 1].gather(-1, target[:, None])[:, 0]
        with torch.no_grad():
            actor.set_adapter("reference")
            ref = torch.log_softmax(actor(input_ids=ids).logits[0].float(), -1)[P - 1 : T - 1].gather(-1, target[:, None])[:, 0]
            actor.set_adapter("default")
        old = torch.tensor(s.logprobs)
        ratio = torch.exp(new - old)
        surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * a)
        delta = ref - new
        losses.append((-(surrogate - kl_beta * (torch.exp(delta) - delta - 1.0))).mean())
    handle.remove()
    torch.stack(losses).mean().backward()
    torch.nn.utils.clip_grad_norm_([p for p in actor.parameters() if p.requires_grad], max_grad_norm)
    optim.step()
    return {n.replace(".default", ""): p.detach() for n, p in actor.named_parameters() if ".default." in n and "lora_" in n}


def test_the_first_step_after_import_is_the_reference_trainers_step(tiny_dir, reference_iter, tmp_path):
    """In process: the learner loaded from the imported checkpoint holds the iter adapter and the AV-SFT
    reference, and its first update on a batch equals the reference trainer's step on that batch
    (its loss, clipping and AdamW from the saved moments), to fp32 tolerance."""
    import yaml
    from safetensors.torch import load_file

    from nla_grpo.learner.policy import POLICY, REFERENCE
    from nla_grpo.learner.learner import Learner
    from nla_grpo.orchestrator.import_run import import_run
    from nla_grpo.orchestrator.run_dir import RunDir
    from nla_grpo.shared.spec import load_spec, sidecar_path
    from test_learner_support import sample_responses

    cfg_path = _config(tiny_dir, tmp_path / "c.yaml")
    raw = yaml.safe_load(cfg_path.read_text())
    raw["injection"] = {"mode": "karvonen", "karvonen_layer": 0}  # the reference trainer's injection
    cfg_path.write_text(yaml.safe_dump(raw))
    lines = []
    run = tmp_path / "run"
    ckpt = import_run(reference_iter["iter"], reference_iter["av_sft"], cfg_path, run, log=lines.append)
    assert ckpt == run / "checkpoints" / "step_000004"
    assert any("not carried over exactly: rollout sampling" in line for line in lines)
    cfg = RunDir.open(run).config()
    assert cfg.data.order == "reference" and cfg.learner.optimizer == "adamw"
    spec = load_spec(sidecar_path(cfg.data.parquet))
    learner = Learner(cfg, spec, "cpu")
    learner.load(ckpt / "policy")
    assert (learner.step, learner.version) == (STEP, STEP + 1)
    policy = load_file(str(reference_iter["iter"] / "adapter_model.safetensors"))
    sft = load_file(str(reference_iter["av_sft"] / "adapter_model.safetensors"))
    for name, saved in ((POLICY, policy), (REFERENCE, sft)):
        live = learner.policy.adapter_parameters(name)
        assert live.keys() == saved.keys() and len(live) == 12
        assert all(torch.equal(p.detach(), saved[k]) for k, p in live.items()), name
    assert learner.param_names == reference_iter["names"]  # the reference optimiser's parameter order

    samples, vectors = sample_responses(tiny_dir, "karvonen", n_prompts=3, group=2, max_new=5)
    advantages = [1.0, -1.0, 0.5, -0.5, 0.2, -0.2]
    start = {k: p.detach().clone() for k, p in learner.policy.adapter_parameters(POLICY).items()}
    metrics = learner.update(samples, advantages, vectors)
    assert not metrics["skipped"]
    expected = _reference_step(tiny_dir, reference_iter, samples, vectors, advantages, cfg.learner.lr, spec.marker_id)
    ours = learner.policy.adapter_parameters(POLICY)
    assert expected.keys() == ours.keys()
    worst = max((ours[k].detach() - expected[k]).abs().max().item() for k in ours)
    moved = min((ours[k].detach() - start[k]).abs().max().item() for k in ours)
    print(f"largest difference from the reference step {worst:.1e}; smallest move {moved:.1e}")
    assert worst <= 1e-6 < moved, (worst, moved)

    # a learner that had started its moments afresh would have taken another step
    learner.load(ckpt / "policy")
    learner.optimizer = torch.optim.AdamW(learner.params, lr=cfg.learner.lr, betas=(0.9, 0.95), weight_decay=0.0)
    learner.update(samples, advantages, vectors)
    assert max((ours[k].detach() - expected[k]).abs().max().item() for k in ours) > 100 * max(worst, 1e-7)


def test_a_co_trained_critic_is_imported_with_the_run(tiny_dir, reference_iter, tmp_path):
    """critic.train: the iter's critic/ through the AR importer into the checkpoint, loadable by the
    critic; its moments restart (said in one line)."""
    import yaml

    from nla_grpo.critic.scoring import Critic
    from nla_grpo.orchestrator.import_run import import_run
    from nla_grpo.orchestrator.run_dir import RunDir
    from nla_grpo.shared.spec import load_spec, sidecar_path

    cfg_path = _config(tiny_dir, tmp_path / "c.yaml")
    raw = yaml.safe_load(cfg_path.read_text())
    raw["critic"].update(train=True)
    cfg_path.write_text(yaml.safe_dump(raw))
    lines = []
    ckpt = import_run(reference_iter["iter"], reference_iter["av_sft"], cfg_path, tmp_path / "run", log=lines.append)
    assert (ckpt / "critic" / "critic_weights.safetensors").is_file() and not (ckpt / "critic.json").exists()
    cfg = RunDir.open(tmp_path / "run").config()
    assert cfg.critic.checkpoint == str((tmp_path / "run" / "imported" / "critic").resolve())
    critic = Critic(cfg, load_spec(sidecar_path(cfg.data.parquet)))
    critic.load(ckpt / "critic")
    assert RunDir(tmp_path / "run").checkpoint_problem(ckpt) is None


def test_an_av_sft_that_is_not_the_runs_anchor_is_refused(tiny_dir, reference_iter, tmp_path):
    from safetensors.torch import load_file, save_file

    from nla_grpo.orchestrator.import_run import import_run

    other = tmp_path / "other_sft"
    shutil.copytree(reference_iter["av_sft"], other)
    t = load_file(str(other / "adapter_model.safetensors"))
    save_file({k: v + 1e-3 if "lora_B" in k else v for k, v in t.items()}, str(other / "adapter_model.safetensors"))
    with pytest.raises(Exception, match=r"--av-sft: its tensors are not those of .*iter_000004/reference, the KL anchor"):
        import_run(reference_iter["iter"], other, _config(tiny_dir, tmp_path / "c.yaml"), tmp_path / "run", log=lambda m: None)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_imported_run_resumes_in_the_reference_order(tiny_dir, reference_iter, tmp_path):
    """Through the command line: import, then `train --resume` one step further; its batch is the
    reference trainer's next one (a reshuffle by the saved generator), and bad inputs are one line."""
    cfg = _config(tiny_dir, tmp_path / "c.yaml")
    run = tmp_path / "run"
    # the failing cases first: each one line, exit 2, no run directory left
    bad = tmp_path / "bad_iter"
    shutil.copytree(reference_iter["iter"], bad)
    import argparse

    torch.save({"version": 1, "step": 4, "args": argparse.Namespace(lr=1e-3)}, bad / "training_state.pt")
    for args, needle in (
        ((bad, "--av-sft", reference_iter["av_sft"], "--config", cfg), "needs arbitrary unpickling, which is refused"),
        ((reference_iter["iter"], "--av-sft", reference_iter["av_sft"], "--config", cfg, "--set", "data.max_rows=32",
          "--set", "data.eval_skip_rows=32"), "pending_idxs: the reference run ordered 64 rows"),
        ((reference_iter["iter"], "--av-sft", tmp_path, "--config", cfg), "--av-sft: expected a PEFT adapter directory"),
    ):
        res = run_cli("import-run", *args, "--run-dir", run, timeout=300)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and needle in res.stderr, res.stderr[-2000:]
        assert not run.exists()

    res = run_cli("import-run", reference_iter["iter"], "--av-sft", reference_iter["av_sft"], "--config", cfg, "--run-dir", run, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "[import] not carried over exactly: critic: the reference run co-trained it" in res.stdout
    res = run_cli("train", "--resume", run, "--steps", str(STEP + 1), timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"[resume] from {run / 'checkpoints' / 'step_000004'}: {STEP} steps done, continuing with step {STEP + 1}" in res.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [STEP + 1] and rows[0]["adapter_version"] == STEP + 2
    state = json.loads((run / "checkpoints" / f"step_{STEP + 1:06d}" / "state.json").read_text())
    rng = np.random.default_rng(SEED)
    rng.bit_generator.state = reference_iter["rng_state"]
    pending = list(reference_iter["pending"])
    batches, cursor = _reference_batches(pending, reference_iter["cursor"], rng, 1)
    assert state["order"]["cursor"] == cursor == PROMPTS and state["order"]["pending"] == pending
    assert pending != reference_iter["pending"]  # the step reshuffled, by the generator state it carried over

"""The driver's failure handling, with light stand-in actors (no engines): a dead actor, a skipped step."""
import os

import pytest

from nla_grpo.orchestrator.groups import CriticGroup, LearnerGroup
from nla_grpo.orchestrator.job import absolute_paths, prepare_job
from nla_grpo.orchestrator.placement import Services
from nla_grpo.orchestrator.run_dir import RunDir
from nla_grpo.shared.config import build_config
from nla_grpo.shared.types import AdapterUpdate, Sample

from conftest import ROOT

pytestmark = pytest.mark.timeout(300)


class FakeLearner:
    def __init__(self, skip_at=None, fail_at=None):
        self.version, self.step, self.skip_at, self.fail_at = 1, 0, skip_at, fail_at
        self.sampled_by = []  # adapter version of the samples each update got

    def versions_seen(self):
        return self.sampled_by

    def weight_sync_rendezvous(self, world_size):
        assert world_size >= 2  # the learner and at least one engine
        return None

    def connect_weight_sync(self, rendezvous):
        pass

    def data_parallel_rendezvous(self, world_size):
        return "127.0.0.1", 0

    def join_data_parallel(self, host, port, rank, world_size, backend):
        self.rank = rank

    def checksum(self):
        return [self.step, self.version]

    def gpu_memory(self):  # what a GPU learner's torch holds once up (these fakes hold nothing)
        return None

    def planned_tokens(self):
        self.planned = getattr(self, "planned", 0) + 1
        return 512 * (1 + getattr(self, "rank", 0)), None

    def times_planned(self):
        return getattr(self, "planned", 0)

    def export_adapter(self):
        return AdapterUpdate(self.version, {}, {})  # stands in for the message: the engines read its version

    def send_adapter(self, message):
        assert message.version == self.version

    def release_export(self, version):
        assert version == self.version

    def save(self, directory, reference=None):
        os.makedirs(directory)

    def save_reference(self, directory):
        os.makedirs(directory)

    def shard_sizes(self):
        return self.sizes

    def update(self, samples, advantages, vectors):
        if self.step == self.fail_at:
            try:
                raise OSError(28, "No space left on device")
            except OSError as exc:
                raise RuntimeError("while writing the learner's scratch file") from exc
        self.sizes = getattr(self, "sizes", []) + [len(samples)]
        self.sampled_by.append(sorted({s.adapter_version for s in samples}))
        skipped = self.step == self.skip_at
        self.step += 1
        if not skipped:
            self.version += 1
        return {"loss": 0.0, "kl_mean": 0.0, "clip_frac": 0.0, "logprob_mismatch_mean_abs": 0.0,
                "logprob_mismatch_k3": 0.0, "masked": 0, "skipped": skipped}


class FakeCritic:
    def __init__(self):
        self.trained = 0

    def score(self, explanations, vectors):
        return [None if e is None else 0.5 for e in explanations]

    def score_share(self, explanations, vectors):  # every world_size-th sample, from this rank's
        return [(i, s) for i, s in enumerate(self.score(explanations, vectors)) if i % self.world == self.rank]

    def train_step(self, explanations, vectors):
        self.trained += 1
        return {"critic_loss": 0.5}

    def gpu_memory(self):
        return None

    def trained_steps(self):
        return self.trained

    def data_parallel_rendezvous(self, world_size):
        return "127.0.0.1", 0

    def join_data_parallel(self, host, port, rank, world_size, backend):
        self.rank, self.world = rank, world_size

    def checksum(self):
        return [self.trained]

    def save(self, directory):
        os.makedirs(directory)


class FakeRollout:
    def __init__(self, group, die_at_call=None):
        self.version, self.calls, self.group, self.die_at_call = 0, 0, group, die_at_call

    def connect_weight_sync(self, rendezvous, rank):
        assert rank >= 1  # rank 0 is the learner

    def load_adapter(self, update):
        self.version = update.version
        return self.version

    def adapter_version(self):
        return self.version

    def describe(self):
        return "a stand-in engine"

    def generate(self, requests, seed, ignore_eos=False, inject=True):
        if self.calls == self.die_at_call:
            os._exit(1)  # the process dies as a crashed engine would
        self.calls += 1
        return [Sample(r.row_id, g, r.prompt_ids, r.site, [5, 6], [-1.0, -1.0], "<explanation>sea</explanation>",
                       "stop", self.version) for r in requests for g in range(self.group)]


def _job(tiny_dir, steps, overlap=False):
    cfg = build_config({"model": {"path": str(tiny_dir / "model")}, "data": {"parquet": str(tiny_dir / "rl.parquet")},
                        "rollout": {"group_size": 2}, "grpo": {"steps": steps, "prompts_per_step": 4, "overlap_rollout": overlap},
                        "critic": {"train": True}, "logging": {"eval_every": 0}, "checkpointing": {"every": 0}}, "test")
    return prepare_job(absolute_paths(cfg, ROOT), log=lambda m: None)


def _services(ray, group, die_at_call=None, skip_at=None, fail_at=None, engines=1):
    from nla_grpo.shared.actors import remote  # as placement makes them remote

    rollouts = [remote(FakeRollout).remote(group, die_at_call) for _ in range(engines)]
    return Services(rollouts, LearnerGroup([remote(FakeLearner).remote(skip_at, fail_at)]),
                    CriticGroup([remote(FakeCritic).remote()]), [], "cpu")


def _failed_run(ray, tiny_dir, tmp_path, steps, **faults):
    """The StepError's message of a run with stand-in actors that fail as ``faults`` say, and its run dir."""
    from nla_grpo.orchestrator.driver import StepError, train

    job = _job(tiny_dir, steps=steps)
    run = RunDir.create(tmp_path / "run", job.cfg)
    with pytest.raises(StepError) as exc:
        train(job, run, _services(ray, 2, **faults), log=lambda m: None)
    return str(exc.value), run


def test_dead_rollout_actor_is_one_line_with_the_step(ray_local, tiny_dir, tmp_path):
    msg, run = _failed_run(ray_local, tiny_dir, tmp_path, 5, die_at_call=2)
    assert msg.startswith("step 3 (rollout): a service actor died (rollout engine 0 of 1): ") and "\n" not in msg
    assert [r["step"] for r in run.read_metrics()] == [1, 2]  # the steps before the crash were logged


def test_skipped_step_keeps_version_and_skips_critic(ray_local, tiny_dir, tmp_path):
    from nla_grpo.orchestrator.driver import train

    job = _job(tiny_dir, steps=4)
    run = RunDir.create(tmp_path / "run", job.cfg)
    lines = []
    services = _services(ray_local, 2, skip_at=1)
    train(job, run, services, log=lines.append)
    rows = run.read_metrics()
    assert [r["skipped"] for r in rows] == [False, True, False, False]
    assert [r["adapter_version"] for r in rows] == [2, 2, 3, 4]
    assert ray_local.get(services.critic.leader.trained_steps.remote()) == 3
    assert any(l.startswith("step 2: optimiser step skipped") for l in lines)
    assert run.latest_checkpoint().name == "step_000004"  # checkpointing.every=0: only at the end


def test_the_start_names_each_kind_of_engine_once(ray_local, tiny_dir, tmp_path):
    from nla_grpo.orchestrator.driver import train

    job = _job(tiny_dir, steps=1)
    lines = []
    train(job, RunDir.create(tmp_path / "run", job.cfg), _services(ray_local, 2, engines=2), log=lines.append)
    assert [l for l in lines if l.startswith("[engine]")] == ["[engine] a stand-in engine"]  # two engines, one kind


@pytest.mark.parametrize("overlap,expected", [(False, [[1], [2], [3], [4]]), (True, [[1], [1], [2], [3]])])
def test_overlap_rolls_out_the_next_step_on_the_adapter_before_the_update(ray_local, tiny_dir, tmp_path, overlap, expected):
    """With overlap, step k+1's samples come from v_k: launched before update k, served before push k."""
    from nla_grpo.orchestrator.driver import train

    job = _job(tiny_dir, steps=4, overlap=overlap)
    run = RunDir.create(tmp_path / "run", job.cfg)
    services = _services(ray_local, 2)
    train(job, run, services, log=lambda m: None)
    assert ray_local.get(services.learner.leader.versions_seen.remote()) == expected
    assert [r["adapter_version"] for r in run.read_metrics()] == [2, 3, 4, 5]


def test_ranks_that_disagree_stop_the_checkpoint_with_one_line(ray_local, tmp_path):
    from nla_grpo.orchestrator.groups import RankFailure

    a, b = ray_local.remote(FakeLearner).remote(), ray_local.remote(FakeLearner).remote()
    group = LearnerGroup([a, b])
    group.save(str(tmp_path / "same"))  # the same state everywhere: rank 0 writes
    assert (tmp_path / "same").is_dir()
    ray_local.get(b.update.remote([], [], None))  # rank 1 took a step rank 0 did not
    with pytest.raises(RankFailure) as exc:
        group.save(str(tmp_path / "differs"))
    assert str(exc.value).startswith("learner rank 1 of 2 disagrees with rank 0 at a checkpoint") and "\n" not in str(exc.value)
    assert not (tmp_path / "differs").exists()  # nothing written


def test_every_learner_rank_plans_its_budget_together_and_rank_0_answers(ray_local):
    a, b = ray_local.remote(FakeLearner).remote(), ray_local.remote(FakeLearner).remote()
    group = LearnerGroup([a, b])
    assert group.planned_tokens() == (512, None)  # rank 0's answer (real ranks agree: they take the minimum together)
    assert ray_local.get([a.times_planned.remote(), b.times_planned.remote()]) == [1, 1]


def test_an_error_inside_an_actor_is_its_cause_in_one_line(ray_local, tiny_dir, tmp_path):
    msg, _ = _failed_run(ray_local, tiny_dir, tmp_path, 4, fail_at=1)
    assert msg == "step 2 (update): learner rank 0 of 1: OSError: [Errno 28] No space left on device", msg


def test_input_errors_and_causes_cross_ray(ray_local):
    import pickle

    from nla_grpo.shared.errors import NlaInputError, one_line

    err = pickle.loads(pickle.dumps(NlaInputError("data.parquet", "row 3: NaN")))
    assert isinstance(err, NlaInputError) and err.where == "data.parquet" and str(err) == "data.parquet: row 3: NaN"

    @ray_local.remote
    def bad_input():
        raise NlaInputError("c.yaml", "learner.lr: expected a number")

    with pytest.raises(NlaInputError) as got:  # Ray re-raises it as its own type
        ray_local.get(bad_input.remote())
    assert one_line(got.value) == "c.yaml: learner.lr: expected a number"


class _Unpicklable(Exception):
    """Like vLLM's config errors: a multi-line message, and state that does not pickle."""

    def __init__(self, detail):
        super().__init__(f"1 validation error for Config\n  Value error, {detail}\n  see the docs")
        import threading

        self.lock = threading.Lock()


def _wrapped(detail):
    try:
        raise _Unpicklable(detail)
    except _Unpicklable as exc:
        raise RuntimeError("engine start failed") from exc


class _FailsToStart:
    def __init__(self, kind):
        if kind == "unpicklable":
            _wrapped("Unsupported storage: bfloat16")
        if kind == "pydantic":
            from pydantic import BaseModel, field_validator

            class EngineConfig(BaseModel):
                max_tokens: int

                @field_validator("max_tokens")
                @classmethod
                def big_enough(cls, v):
                    raise ValueError(f"max_tokens ({v}) is smaller than max_model_len (512)")

            EngineConfig(max_tokens=1)
        from nla_grpo.shared.errors import NlaInputError

        raise NlaInputError("rollout.engine_options", "expected a dict")

    def ping(self):
        return 1


class _FailsInAMethod:
    def boom(self):
        _wrapped("No space left on device")


def test_a_cause_that_cannot_be_pickled_still_crosses_ray_as_its_line(ray_local):
    """Ray replaces an exception it cannot pickle by one naming only its type, and keeps only the text of a
    failed constructor: the actor made by ``shared.actors.remote`` sends the innermost cause's own line."""
    from nla_grpo.orchestrator.driver import startup_error
    from nla_grpo.shared.actors import remote
    from nla_grpo.shared.errors import ServiceError, crossing, one_line

    assert isinstance(crossing(RuntimeError("x")), RuntimeError)  # what pickles crosses as itself
    with pytest.raises(RuntimeError) as got:
        _wrapped("d")
    carried = crossing(got.value)
    assert isinstance(carried, ServiceError) and str(carried) == "_Unpicklable: 1 validation error for Config"

    with pytest.raises(Exception) as got:
        ray_local.get(remote(_FailsInAMethod).remote().boom.remote())
    assert one_line(got.value) == "_Unpicklable: 1 validation error for Config"  # not "isn't serializable"

    for kind, line in (("unpicklable", "_Unpicklable: 1 validation error for Config"),
                       ("pydantic", "ValidationError: EngineConfig: Value error, max_tokens (1) is smaller than max_model_len (512)"),
                       ("input", "rollout.engine_options: expected a dict")):
        actor = remote(_FailsToStart).remote(kind)
        with pytest.raises(Exception) as got:
            ray_local.get(actor.ping.remote())
        assert str(startup_error(got.value)) == f"starting the services: _FailsToStart died: it failed to start: {line}"


def test_one_line_reads_a_validation_error_past_its_header():
    from pydantic import BaseModel, Field, ValidationError

    from nla_grpo.shared.errors import describe, one_line

    class C(BaseModel):
        lr: float = Field(gt=0)

    with pytest.raises(ValidationError) as got:
        C(lr=-1)
    assert describe(got.value) == "ValidationError: C: Input should be greater than 0"
    try:
        raise RuntimeError("wrapper") from got.value
    except RuntimeError as exc:
        assert one_line(exc) == "ValidationError: C: Input should be greater than 0"


def test_one_line_follows_causes_not_the_error_being_handled():
    """``raise X from Y``: Y is the cause. An error raised while another was handled (no ``from``) is the
    one its code chose to report. An input error is the user's line even when it names a cause."""
    from nla_grpo.shared.errors import NlaInputError, one_line

    def chained(outer, inner, explicit):
        try:
            try:
                raise inner
            except Exception as exc:
                if explicit:
                    raise outer from exc
                raise outer
        except Exception as exc:
            return one_line(exc)

    assert chained(RuntimeError("writing"), OSError(28, "No space left on device"), True) == "OSError: [Errno 28] No space left on device"
    assert chained(ValueError("max_model_len 512 exceeds the model's 256"), KeyError("max_model_len"), False) == \
        "ValueError: max_model_len 512 exceeds the model's 256"
    assert chained(NlaInputError("c.yaml", "learner.lr: expected a number"), ValueError("x"), True) == "c.yaml: learner.lr: expected a number"


def test_a_bare_interrupt_is_named_by_the_signal_the_handler_took(monkeypatch):
    """A SIGTERM that lands while the driver waits inside Ray comes back as ``KeyboardInterrupt()`` without
    its name: the line still says SIGTERM (exit 143), from what the handler noted."""
    import nla_grpo.orchestrator.driver as driver

    monkeypatch.setattr(driver, "_received", [])
    assert driver.interrupted_by(KeyboardInterrupt()) == "SIGINT"  # no handler ran: Ctrl-C's default
    driver.note_signal("SIGTERM")
    assert driver.interrupted_by(KeyboardInterrupt()) == "SIGTERM"
    assert driver.interrupted_by(KeyboardInterrupt("SIGINT")) == "SIGINT"  # its own name wins
    assert str(driver.startup_error(KeyboardInterrupt())) == "starting the services: interrupted (SIGTERM)"

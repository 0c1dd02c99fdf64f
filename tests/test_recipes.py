"""Recipes against the judge's checks: the KV-cache engine passes checks 1 and 3 (also after
offload/reload), the GRPO trainer passes check 2 alone and data-parallel over two Ray actors."""

from __future__ import annotations

import socket
import tempfile
import threading

import pytest
import ray

from skills.recipes.grpo_trainer import GRPOTrainer
from skills.recipes.torch_engine import TorchEngine
from targets.api import SamplingParams
from targets.harness.accuracy import check_engine, check_trainer, check_weight_sync, fixed_prompts
from targets.harness.model import model_dir


@pytest.fixture(scope="module")
def path(tiny_spec) -> str:
    return str(model_dir(tiny_spec.model))


def test_torch_engine_passes_engine_and_sync_checks(path, tiny_model, tiny_spec):
    engine = TorchEngine(path)
    assert check_engine(engine, tiny_model, tiny_spec.accuracy).passed
    result = check_weight_sync(engine, engine.load_weights, tiny_model, tiny_spec.accuracy, version=5)
    assert result.passed, result.reasons


def test_torch_engine_offload_reload_keeps_the_loaded_weights(path, tiny_model, tiny_spec):
    engine = TorchEngine(path)
    engine.load_weights(tiny_model.state_dict(), version=0)
    engine.offload()
    assert engine.offloaded
    with pytest.raises(RuntimeError, match="offloaded"):
        engine.generate([[3, 4]], SamplingParams(max_new_tokens=2))
    engine.reload()
    assert check_engine(engine, tiny_model, tiny_spec.accuracy).passed


def test_torch_engine_sampling_matches_its_own_logprobs(path, tiny_model):
    """Sampled tokens' logprobs equal a teacher-forced forward of the same sequence."""
    from targets.harness.reference.engine import next_token_logits

    engine = TorchEngine(path)
    prompts = fixed_prompts(6)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.0, seed=3, stop_token_ids=(1,)))
    for prompt, completion in zip(prompts, out):
        sequence = list(prompt)
        for token, logprob in zip(completion.tokens, completion.logprobs):
            expected = next_token_logits(tiny_model, [sequence])[0].log_softmax(-1)[token]
            assert logprob == pytest.approx(float(expected), abs=1e-4)
            sequence.append(token)


def test_torch_engine_abort_returns_partial_completions(path):
    engine = TorchEngine(path)
    prompts = fixed_prompts(8)
    params = SamplingParams(max_new_tokens=400, temperature=1.0, seed=0)
    timer = threading.Timer(0.05, engine.abort)
    timer.start()
    out = engine.generate(prompts, params)
    timer.join()
    assert {c.finish_reason for c in out} == {"abort"}
    assert all(0 < len(c.tokens) < 400 for c in out)
    again = engine.generate(prompts[:1], SamplingParams(max_new_tokens=3))  # abort does not stick
    assert again[0].finish_reason == "length"


def test_grpo_trainer_passes_trainer_check_with_micro_batches(path, tiny_model, tiny_spec):
    config = tiny_spec.workload.training.config()
    result = check_trainer(lambda state, c: GRPOTrainer(path, c, state=state, micro_batch=3), tiny_model, config, tiny_spec.accuracy)
    assert result.passed, result.reasons


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="vt-ray-"), log_to_driver=False)
    yield
    ray.shutdown()


class _DataParallel:
    """Drives GRPOTrainer ranks on Ray actors as one ``targets.api.Trainer``."""

    def __init__(self, actors) -> None:
        self.actors, self.version = actors, 0

    def train_step(self, batch) -> int:
        versions = ray.get([a.train_step.remote(batch) for a in self.actors])
        assert len(set(versions)) == 1
        self.version = versions[0]
        return self.version

    def state_dict(self):
        return ray.get(self.actors[0].state_dict.remote())


def test_data_parallel_trainer_over_ray_matches_the_reference(ray_session, path, tiny_model, tiny_spec):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tiny_spec.workload.training.config()
    state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    Rank = ray.remote(num_cpus=1)(GRPOTrainer)
    actors = [
        Rank.remote(path, config, rank=r, world_size=2, init_method=f"tcp://127.0.0.1:{port}", state=state)
        for r in range(2)
    ]
    trainer = _DataParallel(actors)
    result = check_trainer(lambda s, c: trainer, tiny_model, config, tiny_spec.accuracy)
    assert result.passed, result.reasons
    first, second = ray.get([a.state_dict.remote() for a in actors])
    assert all((first[k] == second[k]).all() for k in first), "ranks diverged"
    ray.get([a.close.remote() for a in actors])

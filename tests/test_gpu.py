"""The recipes on CUDA (run where a GPU is lent; skipped elsewhere): the torch engine passes the
engine and weight-sync checks on the device, and the trainer passes the trainer check there."""

from __future__ import annotations

import pytest
import torch

from skills.recipes.grpo_trainer import GRPOTrainer
from skills.recipes.torch_engine import TorchEngine
from targets.harness.accuracy import check_engine, check_trainer, check_weight_sync
from targets.harness.model import model_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_torch_engine_on_cuda_passes_engine_and_sync_checks(tiny_spec, tiny_model):
    engine = TorchEngine(str(model_dir(tiny_spec.model)), device="cuda")
    result = check_engine(engine, tiny_model, tiny_spec.accuracy)
    assert result.passed, result.reasons
    result = check_weight_sync(engine, engine.load_weights, tiny_model, tiny_spec.accuracy)
    assert result.passed, result.reasons
    engine.offload()
    assert torch.cuda.memory_allocated() < 1 << 20  # the device copy is really freed
    engine.reload()
    assert check_engine(engine, tiny_model, tiny_spec.accuracy).passed


def test_grpo_trainer_on_cuda_passes_trainer_check(tiny_spec, tiny_model):
    path = str(model_dir(tiny_spec.model))
    config = tiny_spec.workload.training.config()
    result = check_trainer(lambda state, c: GRPOTrainer(path, c, device="cuda", state=state), tiny_model, config, tiny_spec.accuracy)
    assert result.passed, result.reasons

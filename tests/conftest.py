"""Shared fixtures: a private model cache per test session and the tiny CPU target's model."""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile

import pytest

# a model cache of the session's own (children inherit it), removed when the session ends; one the
# caller names is theirs and kept
OWN_CACHE = None if "VIBETRAIN_CACHE" in os.environ else tempfile.mkdtemp(prefix="vibetrain-test-cache-")
if OWN_CACHE is not None:
    os.environ["VIBETRAIN_CACHE"] = OWN_CACHE
# the folders the commands keep for a person to read (a failed check's logs, a calibration's spec) go
# to a folder of the session's own, removed with it, unless the caller names one
OWN_SCRATCH = None if "VIBETRAIN_SCRATCH" in os.environ else tempfile.mkdtemp(prefix="vibetrain-test-scratch-")
if OWN_SCRATCH is not None:
    os.environ["VIBETRAIN_SCRATCH"] = OWN_SCRATCH
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
OUTCOMES = os.environ.get("VIBETRAIN_TEST_OUTCOMES")  # benchmarks/gpu_run.py's: each outcome as it is known


def pytest_runtest_logreport(report):
    """Each test's outcome as soon as it is known, a JSON line of the file ``$VIBETRAIN_TEST_OUTCOMES``
    names: a GPU stage killed in a CUDA call that never returns writes no JUnit report, and the script's
    engine fallback needs the default engine's outcome (a later line of a test overrides an earlier one)."""
    if OUTCOMES is None or not (report.when == "call" or report.failed or report.skipped):
        return
    outcome = "failed" if report.failed else report.outcome
    with open(OUTCOMES, "a") as lines:
        lines.write(json.dumps({"test": report.nodeid.split("::")[-1], "outcome": outcome}) + "\n")


def pytest_sessionfinish(session, exitstatus):
    for what, folder in (("model cache", OWN_CACHE), ("scratch folder", OWN_SCRATCH)):
        if folder is None:
            continue
        try:
            shutil.rmtree(folder)
        except OSError as error:  # a child still writing: said, and the session's result kept
            print(f"\nthe test session's {what} {folder} was not removed: {error}")


@pytest.fixture(scope="session")
def tiny_spec():
    from targets.spec import load_target

    return load_target("tiny-qwen3-cpu")


@pytest.fixture(scope="session")
def _tiny_model_loaded(tiny_spec):
    from targets.harness.model import load_model, model_dir

    return load_model(model_dir(tiny_spec.model))


@pytest.fixture
def tiny_model(_tiny_model_loaded):
    """A fresh copy per test, so a test may train or perturb it freely."""
    return copy.deepcopy(_tiny_model_loaded)


@pytest.fixture
def catalog_yaml():
    """The tiny target's YAML as a dict, for tests that plant a bad field."""
    import yaml

    from targets.spec import CATALOG_DIR

    return yaml.safe_load((CATALOG_DIR / "tiny-qwen3-cpu.yaml").read_text())


@pytest.fixture(scope="session")
def fast_target(tmp_path_factory):
    """tiny-qwen3-cpu with a smaller batch and fewer steps: same mechanisms, shorter runs. With
    ``VIBETRAIN_TEST_TARGET=<id>`` it is another real CPU target of the catalog: for the judge's plants
    on a real environment (``VIBETRAIN_TEST_TARGET=tiny-qwen3-cpu-arithmetic pytest
    tests/test_stack_kit.py -k planted``); tests that simulate it, or name its id, expect the default."""
    import yaml

    from targets.spec import CATALOG_DIR

    base = os.environ.get("VIBETRAIN_TEST_TARGET", "tiny-qwen3-cpu")
    data = yaml.safe_load((CATALOG_DIR / f"{base}.yaml").read_text())
    data["id"] = f"{base}-fast"
    data["workload"].update(batch_size=16, train_steps=4)
    path = tmp_path_factory.mktemp("target") / "fast.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="session")
def sandbox():
    """bubblewrap where it works (CI installs it), else the unisolated subprocess backend, named."""
    from targets.harness.isolation.sandbox import Sandbox, SandboxUnavailable

    try:
        return Sandbox.detect("auto")
    except SandboxUnavailable:
        return Sandbox.detect("subprocess")


@pytest.fixture
def no_process_group_left_behind():
    """A trainer a check made (and never closed) leaves this process rank 0 of 1: the next test that
    wants rank 0 of 2 would be refused. Modules that make trainers use it for every test."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def _ray_holder():
    """The one Ray cluster of the test session (tests/ray_session.py), started when a module first asks
    for it: its address. Its jobs' actors die with each run's driver, so runs never share state."""
    from tests.ray_session import shared_ray_cluster

    with shared_ray_cluster() as address:
        yield address


@pytest.fixture(scope="module")
def shared_ray(_ray_holder):
    """The session's Ray cluster for this module's subprocess-sandbox runs to join: ``RAY_ADDRESS`` is set
    while the module runs, and only then (a module that never asks starts clusters of its own)."""
    with pytest.MonkeyPatch.context() as patch:  # the module-scoped form of the monkeypatch fixture
        patch.setenv("RAY_ADDRESS", _ray_holder)
        yield _ray_holder


@pytest.fixture(scope="module")
def judge_sandbox(shared_ray):
    """For tests of the judge, whose verdicts read the harness's own trace whatever the sandbox: the
    subprocess one, its candidates joining the test session's shared Ray cluster."""
    from targets.harness.isolation.sandbox import Sandbox

    return Sandbox.detect("subprocess")

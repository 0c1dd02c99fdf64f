"""The env_checkpoint technique, seen from the harness's trace: environments whose state a crash
loses (``workload.env_state``) checkpointed after the turns that changed state, real and simulated,
with the audit passing; and its misuses planted: a checkpoint in the middle of a step, a lost
episode kept out of the batch. The real runs join the test session's shared Ray cluster (conftest.py)."""

from __future__ import annotations

import pytest

from targets.harness.measure.metrics import compute_metrics
from tests.technique_run import audited_run, harness_run, planted

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

CRASHING = {  # a crash every fifth step or so; two turns in five change state a crash would lose
    "env_failure_rate": 0.2,
    "env_state": {"change_rate": 0.4, "checkpoint_s": 0.01, "restore_s": 0.05, "checkpoint_mb": 1.0},
    "turns": {"max": 8, "dist": {"kind": "geometric", "mean": 4}},
}


def _by_episode(events, kind: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for e in events:
        if e.kind == kind:
            out.setdefault(e.data["episode"], []).append(e)
    return out


@pytest.mark.parametrize("simulate", [False, True], ids=["real", "simulated"])
def test_checkpoints_follow_exactly_the_turns_that_changed_state_and_no_episode_is_lost(
    tmp_path, fast_target, simulate
):
    """At ``checkpoint_level`` 1 every live turn that changed state is followed by a checkpoint at
    that turn before the episode's next step, no other turn is, and every crash is restored. A turn
    the episode never stepped past (its group cancelled, or the run ended) may have its checkpoint
    cancelled: nobody needs that state."""
    _, events = audited_run(tmp_path, fast_target, {"checkpoint_level": 1}, simulate, CRASHING)
    steps, checkpoints = _by_episode(events, "env_step"), _by_episode(events, "env_checkpoint")
    for episode, taken in steps.items():
        changed = [s.data["turn"] for s in taken if s.data["state_changed"] and not s.data["done"]]
        stepped_past = [turn for turn in changed if turn < len(taken)]
        checkpointed = [c.data["turn"] for c in checkpoints.get(episode, [])]
        assert checkpointed in (stepped_past, changed), episode
        for c in checkpoints.get(episode, []):  # taken after its turn's step and before the next one began
            assert c.data["start"] >= taken[c.data["turn"] - 1].t - 1e-9
            assert all(c.t <= s.t - s.data["latency"] + 1e-9 for s in taken if s.data["turn"] == c.data["turn"] + 1)
    assert not any(s.data["lost"] for taken in steps.values() for s in taken)
    assert any(s.data["failures"] for taken in steps.values() for s in taken)  # crashes happened, were restored
    assert 0 < sum(map(len, checkpoints.values())) < sum(not s.data["done"] for t in steps.values() for s in t)


def test_without_checkpoints_crashes_lose_episodes_which_train_but_are_not_goodput(tmp_path, fast_target):
    _, events = audited_run(tmp_path, fast_target, {}, True, CRASHING)
    lost = {e.data["episode"] for e in events if e.kind == "env_step" and e.data["lost"]}
    trained = {t["episode"] for e in events if e.kind == "train" for t in e.data["trajectories"]}
    assert lost & trained and not any(e.kind == "env_checkpoint" for e in events)
    devices = next(e for e in events if e.kind == "run_start").data["devices"]
    metrics = compute_metrics(events, devices)
    timed_out = {e.data["episode"] for e in events if e.kind == "env_step" and e.data["timed_out"]}
    assert metrics["goodput"] * metrics["duration_s"] == pytest.approx(len(trained - lost - timed_out))
    assert metrics["lost_ratio"] > 0


def test_a_checkpoint_in_the_middle_of_a_step_is_refused(tmp_path, fast_target):
    """A checkpoint taken while the step runs would hold state the turn has not reached; the harness
    refuses it as the controller's error and the run fails with the reason."""
    checkpoint_mid_step = planted(
        "env_manager.py",
        "                result = await episode.step(completion.tokens)\n",
        "                stepping = asyncio.ensure_future(episode.step(completion.tokens))\n"
        "                await asyncio.sleep(0)\n"
        "                await episode.checkpoint()\n"
        "                result = await stepping\n",
    )
    _, run = harness_run(tmp_path, fast_target, {"checkpoint_level": 1}, True, CRASHING, checkpoint_mid_step)
    assert not run.ok and "checkpointed while a step was still running" in run.cause, run.cause


def test_keeping_lost_episodes_out_of_the_batch_fails_the_audit(tmp_path, fast_target):
    """A lost episode is a finished trajectory with reward 0: dropping it (here as max_sequence, a
    reason that does not hold) would train on the survivors only, a choice of samples."""
    honest = "                t.append_turn(completion, result)\n"
    drop_the_lost = planted(
        "env_manager.py",
        honest,
        honest + "                if result.lost:\n"
        "                    self.envs.drop(episode.episode_id, 'max_sequence')\n"
        "                    break\n",
    )
    _, run = harness_run(tmp_path, fast_target, {}, True, CRASHING, drop_the_lost)
    # each group missing its dropped member never completes, and the stack launches others in its place until
    # the harness refuses a group past twice the in-flight bound (the drop's own rule, on a trace:
    # tests/test_audit.py's test_a_max_sequence_drop_of_an_episode_that_had_finished)
    assert not run.ok and "over 2 times the bound of 32 the audit holds a run to" in run.cause, run.cause

"""A serving pool beside the job (ROSE-like targets): the spec and its refusals, the harness's serving
traffic and its SLO measure, and the serving_harvest technique seen from the trace, with its misuses
planted: lending without headroom (the SLO audit), training on a serving device (refused), rollout
on a serving device before it was lent (the mechanism audit)."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from targets.harness.judge.audit import audit_run
from targets.harness.measure.metrics import compute_metrics
from targets.harness.sim.cost_model import CostModel
from targets.harness.sim.serving import ServingPool, serving_capacity
from targets.harness.sim.virtual_time import run_virtual
from targets.harness.trace import Trace
from targets.spec import CATALOG_DIR, SpecError, load_target, parse_target
from tests.technique_run import planted, round_hints, target_run

SERVING = "qwen3-8b-h800x16-serving"


def _catalog() -> dict:
    return yaml.safe_load((CATALOG_DIR / f"{SERVING}.yaml").read_text())


def _small() -> dict:
    """The ROSE-like target at a quarter of its size: 4 job devices beside 4 serving ones, whose
    traffic needs 2 of them at its quiet rate and all 4 at its burst."""
    data = _catalog()
    job, serving = data["hardware"]["pools"]
    job["count"] = serving["count"] = 4
    serving["serving"].update(rate=[[0, 20], [90, 60], [150, 20]], period_s=240)
    data["workload"].update(batch_size=64, train_steps=3)
    data["baselines"] = [{"name": "time_multiplex", "train_devices": 2}]
    return data


def _real(burst_at: float | None = None) -> dict:
    """A real CPU target beside a serving pool: the tiny CPU target's 2 devices and 2 serving ones,
    whose traffic (a model of ~6M parameters, 64-token prompts, 16-token answers) one device serves
    within its SLOs up to ~14 requests/s by the harness's profile: 0.5 requests/s (the harvester
    lends one device: with its margin of 0.6 a spike of 4 arrivals in one reading would be needed to
    give it back, about 1 in 5,000), and from ``burst_at`` seconds into the run 12 (a give-back)."""
    data = yaml.safe_load((CATALOG_DIR / "tiny-qwen3-cpu.yaml").read_text())
    data["id"] = "tiny-qwen3-cpu-serving"
    data["workload"].update(batch_size=16, train_steps=3)
    model = {
        "family": "qwen3",
        "dtype": "float32",
        "weights": "random(1)",
        "config": {
            "vocab_size": 64,
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "max_position_embeddings": 512,
        },
    }
    serving = {
        "model": model,
        "prompt_tokens": 64,
        "output_tokens": 16,
        "rate": [[0, 0.5]] if burst_at is None else [[0, 0.5], [burst_at, 12]],
        "period_s": 1000,
        "slo": {"ttft_p99_ms": 500, "tpot_p99_ms": 60},
    }
    data["hardware"] = {
        "pools": [
            {"name": "cpu", "kind": "cpu", "count": 2},
            {"name": "serving", "kind": "cpu", "count": 2, "serving": serving},
        ],
        "links": [{"between": ["cpu", "serving"], "bandwidth_gbs": 10}],
    }
    return data


def test_the_serving_target_lends_a_pool_the_job_does_not_own():
    spec = load_target(SERVING)
    assert spec.hardware.count == 16 and spec.hardware.device_ids()[-1] == "h800:15"
    assert spec.hardware.serving_device_ids() == [f"serving:{i}" for i in range(16)]
    assert spec.hardware.summary == "16x h800 (h800) + 16x h800 (serving, serving)"
    serving = spec.hardware.serving_pools[0].serving
    assert serving.rate_at(250.0) == (240, 20.0) and serving.rate_at(310.0) == (60, 200.0)  # it repeats


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.update(rate=[[5, 80]]), "hardware.pools.1.serving"),
        (lambda s: s.update(rate=[[0, 80], [600, 90]]), "not within period_s"),
        (lambda s: s.update(rate=[[0, 80], [60, -1]]), "rate.1: a rate of -1.0 requests/s is negative"),
        (lambda s: s.update(rate=[[0, 80], [0, 90]]), "rate.1: 0.0 s does not come after 0.0 s"),
        (lambda s: s["slo"].pop("tpot_p99_ms"), "tpot_p99_ms"),
        (lambda s: s.update(rate=[[0, 0], [60, 0]]), "rate: every point is 0 requests/s"),  # the traffic hung
    ],
    ids=["start", "period", "negative", "order", "slo", "no traffic"],
)
def test_a_bad_serving_field_is_named_by_its_path(change, message):
    data = _catalog()
    change(data["hardware"]["pools"][1]["serving"])
    with pytest.raises(SpecError, match=message):
        parse_target(data)


def test_serving_pools_are_one_and_real_on_cpu_only():
    data = _catalog()
    data["execution"] = "real"
    with pytest.raises(SpecError, match=r"hardware.pools.1.serving: a serving pool runs for real on CPU targets only"):
        parse_target(data)
    assert parse_target(_real()).execution == "real"
    data = _catalog()
    data["hardware"]["pools"][0]["serving"] = data["hardware"]["pools"][1]["serving"]
    with pytest.raises(SpecError, match="every pool serves"):
        parse_target(data)
    data = _catalog()
    third = {**data["hardware"]["pools"][1], "name": "serving2"}
    data["hardware"]["pools"].append(third)
    data["hardware"]["links"] += [
        {"between": ["h800", "serving2"], "bandwidth_gbs": 25},
        {"between": ["serving", "serving2"], "bandwidth_gbs": 25},
    ]
    with pytest.raises(SpecError, match="2 serving pools; a target may have one"):
        parse_target(data)


def _pool_run(rate: float, devices: int, seconds: float = 120.0, lend: int = 0, finish: bool = False) -> dict:
    """The small target's serving pool alone at a constant ``rate``, ``lend`` devices lent at the start;
    with ``finish`` the requests in flight at the end are served out, as a run's end does."""
    spec = parse_target(_small())
    pool = spec.hardware.serving_pools[0]
    constant = pool.serving.model_copy(update={"rate": ((0.0, rate),)})
    cost = CostModel.from_spec(spec, "serving", pool.serving.model)

    async def main() -> dict:
        serving = ServingPool(constant, [f"serving:{i}" for i in range(devices)], cost, 0, capacity_rps=1.0)
        await asyncio.gather(*(serving.lend(f"serving:{i}") for i in range(lend)))
        await asyncio.sleep(seconds)
        load, end = serving.load(), asyncio.get_running_loop().time()
        if finish:
            await serving.finish()
        serving.close()
        return {**serving.summary(end), "load": load, "prefill_s": cost.prefill_s(constant.prompt_tokens, 0)}

    return run_virtual(main())


def test_a_serving_engine_is_sized_for_its_own_requests_not_the_jobs():
    """The serving model's engines were refused for the job's max_sequence, which they never serve."""
    data = _small()
    data["workload"]["tokens"]["max_sequence"] = 10**7  # no engine holds it; the serving requests are short
    spec = parse_target(data)
    pool = spec.hardware.serving_pools[0]
    assert CostModel.from_spec(spec, "serving", pool.serving.model).kv_capacity_tokens < 10**7
    data = _small()
    data["hardware"]["pools"][1]["serving"]["prompt_tokens"] = 10**7
    spec = parse_target(data)
    with pytest.raises(ValueError, match=r"of pool serving: .* \(hardware.pools.1.serving.prompt_tokens"):
        CostModel.from_spec(spec, "serving", spec.hardware.serving_pools[0].serving.model)


def test_the_serving_pool_holds_its_slo_with_headroom_and_counts_requests_that_never_started():
    calm = _pool_run(rate=20.0, devices=4)
    assert calm["ttft_p99_s"] == pytest.approx(calm["prefill_s"])  # nobody queues: TTFT is the prefill
    assert calm["tpot_p99_s"] < calm["tpot_slo_s"] and calm["requests"] > 2000
    assert calm["load"].rate_rps == pytest.approx(20.0, rel=0.3) and calm["load"].serving == 4
    swamped = _pool_run(rate=200.0, devices=4, lend=3)  # one device left for ten times what it serves
    assert swamped["ttft_p99_s"] > swamped["ttft_slo_s"] and swamped["requests"] > swamped["finished"]
    assert swamped["load"].serving == 1 and swamped["load"].lent == 3
    assert swamped["lent_device_s"] == pytest.approx(3 * 120.0, rel=0.1)


def test_the_end_of_a_run_serves_out_every_request_it_left_in_flight():
    """A job's end is not the traffic's: what arrived before it is measured to its last token, and the
    device-seconds lent stop with the job."""
    cut = _pool_run(rate=30.0, devices=2, lend=1, seconds=60.0)
    served = _pool_run(rate=30.0, devices=2, lend=1, seconds=60.0, finish=True)
    assert cut["requests"] > cut["finished"]  # the end caught requests in flight
    assert served["requests"] == served["finished"] == cut["requests"]  # the same arrivals, all served
    assert served["lent_device_s"] == pytest.approx(cut["lent_device_s"]) == pytest.approx(60.0, rel=0.1)


def test_a_serving_model_that_needs_several_devices_an_engine_is_refused_with_the_spec(tmp_path):
    """The pool serves and lends one engine a device: a 72B serving model (4 H800s an engine) was simulated
    one a device, each with its engine's bandwidth and KV room, a pool of four times its hardware whose
    headroom a stack could borrow. Refused as the target loads, naming the field."""
    from targets.harness.target import Target

    data = _catalog()
    model = data["hardware"]["pools"][1]["serving"]["model"]
    model["params"] = {"total": 72.7e9, "active": 72.7e9}
    shape = {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8}
    model["config"].update(hidden_size=8192, intermediate_size=29568, **shape)
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError, match=r"hardware.pools.1.serving.model: its 145 GB of weights need 4 devices"):
        Target.load(tmp_path / "t.yaml")


def test_borrowed_serving_engines_are_the_devices_the_stack_names_in_their_order():
    """Engines of 4 devices over 16 serving ones were grouped in string order (serving:0, 1, 10, 11): a
    stack lending serving:0-3 woke two engines, 8 devices. They are grouped in the pool's order; and a
    spec listing its serving pool first still prices the job's shared terms on the job's pool."""
    from targets.api import Device
    from targets.harness.sim.cluster import SimCluster
    from targets.harness.sim.cost_model import ClusterCosts

    data = _catalog()
    data["simulator"] = {"engine_devices": 4}
    spec = parse_target(data)
    pool = spec.hardware.serving_pools[0]
    cost = CostModel.from_spec(spec, pool.name, pool.serving.model)

    async def borrowed():
        serving = ServingPool(pool.serving, spec.hardware.serving_device_ids(), cost, 0, 1.0)
        cluster = SimCluster([], [], ClusterCosts.from_spec(spec), None, serving)
        asked = [Device(d, "h800", i) for i, d in enumerate(spec.hardware.serving_device_ids()[:4])]
        woken = [engine.devices for engine in cluster._engines_on(asked)]
        serving.close()
        return woken

    assert run_virtual(borrowed()) == [[f"serving:{i}" for i in range(4)]]
    data["hardware"]["pools"] = data["hardware"]["pools"][::-1]
    reversed_costs = ClusterCosts.from_spec(parse_target(data))
    assert reversed_costs.shared is reversed_costs.pools["h800"]


def test_the_last_serving_device_is_never_lent():
    with pytest.raises(ValueError, match="would leave the serving pool no device"):
        _pool_run(rate=10.0, devices=2, lend=2)


def test_an_engine_s_devices_are_lent_together_or_not_at_all():
    """A rollout engine of several serving devices was lent one device at a time: refused at its last
    device, the first ones stayed lent and drained for the rest of the run, their engine never active
    and never given back. The whole engine is checked first."""
    spec = parse_target(_small())
    pool = spec.hardware.serving_pools[0]
    cost = CostModel.from_spec(spec, "serving", pool.serving.model)

    async def main():
        serving = ServingPool(pool.serving, [f"serving:{i}" for i in range(4)], cost, 0, capacity_rps=1.0)
        try:
            await serving.lend_all(["serving:0", "serving:1"])
            with pytest.raises(
                ValueError, match=r"lending \['serving:2', 'serving:3'\] would leave the serving pool no"
            ):
                await serving.lend_all(["serving:2", "serving:3"])
            return set(serving.lent)
        finally:
            serving.close()

    assert run_virtual(main()) == {"serving:0", "serving:1"}  # nothing of the refused engine lent


def test_the_capacity_profile_is_a_rate_one_device_holds_its_slos_at():
    spec = parse_target(_small())
    pool = spec.hardware.serving_pools[0]
    capacity = serving_capacity(pool.serving, CostModel.from_spec(spec, "serving", pool.serving.model))
    assert 5 < capacity < 40
    held = _pool_run(rate=0.8 * capacity, devices=1, seconds=300.0)
    assert held["ttft_p99_s"] <= held["ttft_slo_s"] and held["tpot_p99_s"] <= held["tpot_slo_s"]
    broken = _pool_run(rate=1.5 * capacity, devices=1, seconds=300.0)
    assert broken["ttft_p99_s"] > broken["ttft_slo_s"]


@pytest.fixture(scope="module")
def harvested(tmp_path_factory):
    """The time_multiplex starter with serving_harvest on the small target, simulated: (spec, events)."""
    spec, run = target_run(
        tmp_path_factory.mktemp("harvest"), _small(), {"serving_harvest": 1, "harvest_margin": 1.0}, True
    )
    assert run.ok, run.cause
    assert run.results["audit"]["result"]["passed"], run.results["audit"]["result"]["reasons"]
    return spec, Trace.load_events(run.out / "trace.jsonl"), run.results["system"]


@pytest.mark.slow
def test_harvest_lends_serving_devices_to_rollout_and_the_slo_holds(harvested):
    spec, events, child = harvested
    serving = set(spec.hardware.serving_device_ids())
    lent = [e for e in events if e.kind == "expand" and serving & set(e.data["devices"])]
    given_back = [e for e in events if e.kind == "shrink" and serving & set(e.data["devices"])]
    turns = [e for e in events if e.kind == "generate" and e.data["device"] in serving]
    assert lent and given_back and turns  # borrowed at the quiet rate, some given back at the burst
    for turn in turns:  # each between an expand of its device and the shrink after it
        device = turn.data["device"]
        since = max(e.t for e in lent if device in e.data["devices"] and e.t <= turn.data["start"])
        assert not any(since < e.data["start"] < turn.data["start"] for e in given_back if device in e.data["devices"])
    for train in (e for e in events if e.kind == "train"):
        assert not serving & set(train.data["devices"])
    synced = {d for e in events if e.kind == "sync" for d in e.data["devices"]}
    assert synced & serving  # lent engines load the versions trained while they are lent
    record = next(e for e in events if e.kind == "serving").data
    assert record["ttft_p99_s"] <= record["ttft_slo_s"] and record["lent_device_s"] > 0
    metrics = compute_metrics(events, spec.hardware.device_ids())
    assert 0 < metrics["lent_devices"] < 4 and metrics["serving_tpot_p99_s"] == record["tpot_p99_s"]
    # what lending cost rollout, counted from the same trace
    assert (metrics["serving_lends"], metrics["serving_give_backs"]) == (len(lent), len(given_back))
    cut = [e for e in events if e.kind == "generate" and e.data["aborted"] and e.data.get("device") in serving]
    assert metrics["serving_aborted_turns"] == len(cut)
    # a round's evaluator reads the lending from the summary it keeps (p99 far under its SLO: headroom)
    (hint,) = [h for h in round_hints(spec, events, child) if h.code == "serving_headroom"]
    assert hint.evidence["lent_devices"] == pytest.approx(metrics["lent_devices"]) and hint.evidence["lent_devices"] > 0


@pytest.mark.slow
def test_a_controller_that_routes_its_turns_routes_them_to_the_lent_engines_too(tmp_path):
    """With kv_routing the controller's router sends every turn; the engines lent join what it routes to."""
    params = {"serving_harvest": 1, "harvest_margin": 1.0, "kv_routing": 1}
    spec, run = target_run(tmp_path, _small(), params, True)
    assert run.ok and run.results["audit"]["result"]["passed"], (run.cause, run.results["audit"])
    serving = set(spec.hardware.serving_device_ids())
    events = Trace.load_events(run.out / "trace.jsonl")
    assert sum(e.kind == "generate" and e.data["device"] in serving for e in events) > 20


@pytest.mark.slow
def test_the_starter_alone_never_touches_the_serving_pool(tmp_path):
    spec, run = target_run(tmp_path, _small(), {}, True)
    assert run.ok and run.results["audit"]["result"]["passed"], run.cause
    events = Trace.load_events(run.out / "trace.jsonl")
    serving = set(spec.hardware.serving_device_ids())
    assert not any(serving & set(e.data.get("devices", [])) for e in events if e.kind in ("expand", "shrink"))
    assert next(e for e in events if e.kind == "serving").data["lent_device_s"] == 0


@pytest.mark.slow
def test_lending_without_headroom_breaks_the_slo_and_the_audit_rejects_the_run(tmp_path):
    greedy = planted(
        "serving_harvest.py",
        "        keep = max(1, needed, load.serving + math.ceil(load.lent / 2) if hot else 0)",
        "        keep = 1",
    )
    _, run = target_run(tmp_path, _small(), {"serving_harvest": 1}, True, patch=greedy)
    assert run.ok, run.cause
    audit = run.results["audit"]["result"]
    assert not audit["passed"] and any(r.startswith("serving SLO: the serving traffic's p99") for r in audit["reasons"])


@pytest.mark.slow
def test_training_on_a_serving_device_is_refused(tmp_path):
    trains_on_serving = planted(
        "controller_base.py",
        "        self.version = await cluster.train(TrainBatch(batch, group_advantages(batch)), devices)",
        "        devices = [*devices, *self.serving_devices[:1]]\n"
        "        self.version = await cluster.train(TrainBatch(batch, group_advantages(batch)), devices)",
    )
    _, run = target_run(tmp_path, _small(), {}, True, patch=trains_on_serving)
    assert not run.ok and "['serving:0'] serve production traffic: rollout may borrow them, training never" in (
        run.cause
    )


@pytest.mark.slow
def test_rollout_on_a_serving_device_before_it_was_lent_is_rejected(harvested):
    """The harness's simulator never does it; the audit would catch a cluster that did: the trace with
    the serving devices' expands taken out shows them serving turns they were never lent for."""
    spec, events, _ = harvested
    serving = set(spec.hardware.serving_device_ids())
    unlent = [e for e in events if not (e.kind == "expand" and serving & set(e.data["devices"]))]
    result = audit_run(spec, unlent, lambda version: None, None, spec.workload.train_steps)
    assert not result.passed and any(r.startswith("served while shrunk: serving:") for r in result.reasons)
    doctored = [e for e in events if e.kind != "serving"]
    result = audit_run(spec, doctored, lambda version: None, None, spec.workload.train_steps)
    assert not result.passed and "serving SLO: the run has no record of its serving pool's traffic" in result.reasons


# -- for real on CPU: the candidate's engines on the serving devices, the harness's traffic on the wall clock


def _serving_windows(spec, events) -> tuple[list, list, list]:
    """(expands and shrinks of serving devices, the turns served there) in a real run's trace, after
    checking each turn came while its device was lent: after an expand of it, before the shrink after."""
    serving = set(spec.hardware.serving_device_ids())
    lent = [e for e in events if e.kind == "expand" and serving & set(e.data["devices"])]
    given_back = [e for e in events if e.kind == "shrink" and serving & set(e.data["devices"])]
    turns = [e for e in events if e.kind == "generate" and e.data["device"] in serving and not e.data["aborted"]]
    for turn in turns:
        device = turn.data["device"]
        since = max(e.t for e in lent if device in e.data["devices"] and e.t <= turn.data["start"])
        assert not any(since < e.data["start"] < turn.data["start"] for e in given_back if device in e.data["devices"])
    assert not any(serving & set(e.data["devices"]) for e in events if e.kind == "train")
    record = next(e for e in events if e.kind == "serving").data
    assert record["requests"] == record["finished"] > 0 and record["lent_device_s"] > 0
    assert record["ttft_p99_s"] <= record["ttft_slo_s"] and record["tpot_p99_s"] <= record["tpot_slo_s"]
    return lent, given_back, turns


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray")
def test_a_real_harvest_rolls_out_on_a_lent_engine_that_loads_each_version_trained(tmp_path):
    """The candidate's Ray cluster keeps an engine asleep on each serving device; at quiet traffic the
    harvester lends one at once: its engine wakes, rolls out, and loads each version trained while it
    is lent; the harness served the traffic beside it and every request kept its SLOs."""
    spec, run = target_run(tmp_path, _real(), {"serving_harvest": 1}, False)
    assert run.ok and run.results["audit"]["result"]["passed"], (run.cause, run.results.get("audit"))
    events = Trace.load_events(run.out / "trace.jsonl")
    lent, _, turns = _serving_windows(spec, events)
    assert lent and turns
    synced = {e.data["version"] for e in events if e.kind == "sync" and "serving:1" in e.data["devices"]}
    assert synced and max(t.data["version"] for t in turns) > 0  # it sampled a version trained while lent
    resident = [e.data["resident"] for e in events if e.kind == "device_state"]
    assert resident[0] == {"cpu:0": ["engine"], "cpu:1": ["engine"], "serving:0": [], "serving:1": []}
    assert any(r["serving:1"] == ["engine"] for r in resident) and all(r["serving:0"] == [] for r in resident)


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray")
def test_a_real_harvest_gives_the_device_back_when_the_traffic_bursts(tmp_path):
    spec, run = target_run(tmp_path, _real(burst_at=1.0), {"serving_harvest": 1}, False)
    assert run.ok and run.results["audit"]["result"]["passed"], (run.cause, run.results.get("audit"))
    events = Trace.load_events(run.out / "trace.jsonl")
    lent, given_back, turns = _serving_windows(spec, events)
    assert lent and given_back and turns
    resident = [e.data["resident"] for e in events if e.kind == "device_state"]
    assert resident[-1]["serving:1"] == []  # its engine asleep again


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray")
def test_a_real_cluster_whose_serving_engines_roll_out_unlent_is_rejected(tmp_path):
    """The misuse, planted in the candidate's Ray cluster: its serving devices' engines awake and
    taking turns from the start, as if lent; the audit sees them serve outside any expand."""
    unlent = planted(
        "ray_cluster.py",
        "        self._awake = {d.id for d in rollout}  # engines holding their device\n"
        "        self._active = {d.id for d in rollout}  # engines taking requests",
        "        self._awake = set(self._engines)\n        self._active = set(self._engines)",
    )
    wake = planted(
        "ray_cluster.py",
        "            *(actors[d.id].sleep.remote() for d in lendable),  # asleep until borrowed",
        "            *(actors[d.id].weight_version.remote() for d in lendable),",
    )

    def both(stack_dir) -> None:
        unlent(stack_dir)
        wake(stack_dir)

    data = _real()
    data["workload"]["train_steps"] = 2  # enough to see it: an unlent engine is never synced, and its stale turns churn
    _, run = target_run(tmp_path, data, {"serving_harvest": 1}, False, patch=both)
    assert run.ok, run.cause
    audit = run.results["audit"]["result"]
    assert not audit["passed"] and any(r.startswith("served while shrunk: serving:") for r in audit["reasons"]), audit


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray")
def test_training_on_a_serving_device_is_refused_by_the_harness_in_a_real_run(tmp_path):
    trains_on_serving = planted(
        "controller_base.py",
        "        self.version = await cluster.train(TrainBatch(batch, group_advantages(batch)), devices)",
        "        devices = [*devices, *self.serving_devices[:1]]\n"
        "        self.version = await cluster.train(TrainBatch(batch, group_advantages(batch)), devices)",
    )
    data = _real()
    data["workload"]["train_steps"] = 1
    _, run = target_run(tmp_path, data, {}, False, patch=trains_on_serving)
    assert not run.ok and "['serving:0'] serve production traffic: rollout may borrow them, training never" in (
        run.cause
    )


def test_a_pinned_engine_size_is_the_jobs_model_never_the_serving_pools_nor_the_judges():
    """simulator.engine_devices, the stack's engine size, was applied to the serving model and the judge
    too: each serving device (one engine a device) was priced with two devices' bandwidth and KV."""
    from targets.harness.sim.cost_model import ClusterCosts, CostModel
    from targets.spec import load_target

    for target in ("qwen3-8b-h800x16-serving", "qwen3-8b-h800x16-judge"):
        spec = load_target(target)
        pinned = spec.model_copy(update={"simulator": spec.simulator.model_copy(update={"engine_devices": 2})})
        assert ClusterCosts.from_spec(pinned).engine_devices == 2  # the job's own engines: as pinned
        if target.endswith("serving"):
            pool = pinned.hardware.serving_pools[0]
            assert CostModel.from_spec(pinned, pool.name, pool.serving.model).engine_devices == 1
        else:
            assert ClusterCosts.from_spec(pinned, pinned.workload.reward_model.model).engine_devices == 1

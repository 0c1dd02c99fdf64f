"""Run by tests/test_vllm_engine.py in a child process (vLLM spawns workers: needs a __main__ guard).
Prints one JSON line: the judge's engine and weight-sync checks on VLLMEngine, and offload/reload."""

import json
import sys

if __name__ == "__main__":
    from skills.recipes.vllm_engine import VLLMEngine
    from targets.harness.accuracy import check_engine, check_weight_sync
    from targets.harness.model import load_model, model_dir
    from targets.spec import load_target

    spec = load_target("tiny-qwen3-cpu")
    path = model_dir(spec.model)
    reference = load_model(path)
    engine = VLLMEngine(str(path), spec.model.dtype)
    first = check_engine(engine, reference, spec.accuracy)
    engine.offload()
    engine.reload()
    after_reload = check_engine(engine, reference, spec.accuracy)
    sync = check_weight_sync(engine, engine.load_weights, reference, spec.accuracy, version=2)
    print(json.dumps({c.name + suffix: {"passed": c.passed, "reasons": c.reasons, "details": c.details}
                      for c, suffix in ((first, ""), (after_reload, "_after_reload"), (sync, ""))}))
    sys.stdout.flush()

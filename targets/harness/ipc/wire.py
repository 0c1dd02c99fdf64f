"""The contract's types on the channel: each ``targets.api`` value as a frame header entry plus blobs.

Decoders treat every input as hostile: each field is checked for its type and range, and anything
else raises ``ProtocolError`` naming the field. Long token sequences travel as typed arrays, and a
turn's prompt (usually the previous prompt plus a response and an observation) travels as a
reference to the episode's previous prompt plus the new suffix (``PromptMemory``).

A simulated run records token counts, never tokens (its cluster is the harness's own cost model),
so on a simulated controller link every token sequence travels as a count (``TokenCount``): prompts,
completions (their logprobs with them), actions, observations and trajectories. A 64K-token context
costs the same as a short one, and the audit checks the counts it always checked.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import orjson

from targets.api import (
    MAX_SPECULATIVE_TOKENS,
    Aborted,
    Completion,
    Declared,
    Device,
    EngineSettings,
    GenerateRequest,
    Runtime,
    SamplingParams,
    StateDict,
    StepResult,
    TokenCount,
    TrainBatch,
    TrainingConfig,
    Trajectory,
    Workload,
)
from targets.harness.ipc.channel import Frame, Received
from targets.harness.ipc.protocol import ProtocolError

FINISH_REASONS = ("stop", "length", "abort")


# -- checked field access --------------------------------------------------------------------------


def field_of(data: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(data, dict) or key not in data:
        raise ProtocolError(f"{where}: missing field {key!r}")
    value = data[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"{where}.{key}: expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(f"{where}.{key}: {value} is not a finite number")
    return value


def _ints(data: Any, key: str, where: str) -> list[int]:
    values = field_of(data, key, list, where)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ProtocolError(f"{where}.{key}: expected a list of integers")
    return values


# -- small values ------------------------------------------------------------------------------------


_PARAMS_PUT: dict[int, tuple[SamplingParams, dict]] = {}  # by identity: a controller sends one object, every turn


def put_params(p: SamplingParams) -> dict:
    seen = _PARAMS_PUT.get(id(p))
    if seen is not None and seen[0] is p:
        return seen[1]
    out = {"max_new_tokens": p.max_new_tokens, "temperature": p.temperature, "seed": p.seed}
    out["stop_token_ids"] = list(p.stop_token_ids)
    if len(_PARAMS_PUT) >= 64:
        _PARAMS_PUT.clear()
    _PARAMS_PUT[id(p)] = (p, out)  # holding p keeps its id from being reused while the entry lives
    return out


_PARAMS_SEEN: dict[bytes, SamplingParams] = {}  # a controller sends the same few, every turn


def get_params(d: Any) -> SamplingParams:
    """Checked once per distinct value: the cache is keyed by the value's JSON, which keeps
    ``1``, ``1.0`` and ``true`` apart, so whatever it returns was checked as that exact value."""
    key = orjson.dumps(d)
    params = _PARAMS_SEEN.get(key)
    if params is None:
        params = _checked_params(d)
        if len(_PARAMS_SEEN) >= 64:
            _PARAMS_SEEN.clear()
        _PARAMS_SEEN[key] = params
    return params


def _checked_params(d: Any) -> SamplingParams:
    seed = d.get("seed") if isinstance(d, dict) else None
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ProtocolError("params.seed: expected an integer or null")
    try:
        return SamplingParams(
            field_of(d, "max_new_tokens", int, "params"),
            field_of(d, "temperature", float, "params"),
            seed,
            tuple(_ints(d, "stop_token_ids", "params")),
        )
    except ValueError as error:
        raise ProtocolError(f"params: {error}") from None


def put_config(c: TrainingConfig) -> dict:
    return {
        "lr": c.lr,
        "clip_eps": c.clip_eps,
        "kl_coef": c.kl_coef,
        "max_grad_norm": c.max_grad_norm,
        "betas": list(c.betas),
        "eps": c.eps,
        "weight_decay": c.weight_decay,
        "temperature": c.temperature,
    }


def get_config(d: Any) -> TrainingConfig:
    betas = field_of(d, "betas", list, "config")
    if len(betas) != 2 or not all(isinstance(b, (int, float)) for b in betas):
        raise ProtocolError("config.betas: expected two numbers")
    floats = {
        k: field_of(d, k, float, "config")
        for k in ("lr", "clip_eps", "kl_coef", "max_grad_norm", "eps", "weight_decay", "temperature")
    }
    return TrainingConfig(**floats, betas=(float(betas[0]), float(betas[1])))


def put_devices(devices) -> list[dict]:
    return [
        {
            "id": d.id,
            "kind": d.kind,
            "index": d.index,
            "bf16_tflops": d.bf16_tflops,
            "hbm_bandwidth_gbs": d.hbm_bandwidth_gbs,
        }
        for d in devices
    ]


def get_devices(data: Any) -> list[Device]:
    if not isinstance(data, list):
        raise ProtocolError("devices: expected a list")
    return [
        Device(
            field_of(d, "id", str, "device"),
            field_of(d, "kind", str, "device"),
            field_of(d, "index", int, "device"),
            field_of(d, "bf16_tflops", float, "device"),
            field_of(d, "hbm_bandwidth_gbs", float, "device"),
        )
        for d in data
    ]


def put_runtime(r: Runtime) -> dict:
    w = r.workload
    workload = {f.name: getattr(w, f.name) for f in dataclasses.fields(w) if f.name != "training"}
    return {
        "model_path": r.model_path,
        "dtype": r.dtype,
        "devices": put_devices(r.devices),
        "device_resource": r.device_resource,
        "stop_token_ids": list(r.stop_token_ids),
        "accelerator": r.accelerator,
        "device_memory_bytes": r.device_memory_bytes,
        "engine_devices": r.engine_devices,
        "serving_devices": put_devices(r.serving_devices),
        "workload": {**workload, "training": put_config(w.training)},
    }


def get_runtime(d: dict) -> Runtime:
    """Only candidate processes decode a runtime (the harness wrote it): no hostile input here."""
    w = d["workload"]
    workload = Workload(**{k: v for k, v in w.items() if k != "training"}, training=get_config(w["training"]))
    return Runtime(
        d["model_path"],
        d["dtype"],
        tuple(get_devices(d["devices"])),
        d["device_resource"],
        tuple(d["stop_token_ids"]),
        workload,
        d["accelerator"],
        d["device_memory_bytes"],
        d["engine_devices"],
        tuple(get_devices(d["serving_devices"])),
    )


REWARD_PLACEMENTS = ("colocated", "dedicated", "serverless")
ENGINE_SCALES = (1, 2, 4)  # the multiples of the target's engine size an engine may span


def put_engine_settings(e: EngineSettings) -> dict:
    return {
        "speculative_tokens": e.speculative_tokens,
        "speculative_batch": e.speculative_batch,
        "reward": e.reward,
        "reward_devices": list(e.reward_devices),
        "engine_scale": e.engine_scale,
        "host_kv_tokens": e.host_kv_tokens,
        "prefill_chunk": e.prefill_chunk,
    }


def get_engine_settings(data: Any) -> EngineSettings:
    tokens = field_of(data, "speculative_tokens", int, "engine")
    batch = field_of(data, "speculative_batch", int, "engine")
    reward = field_of(data, "reward", str, "engine")
    devices = field_of(data, "reward_devices", list, "engine")
    scale = field_of(data, "engine_scale", int, "engine")
    host_kv = field_of(data, "host_kv_tokens", int, "engine")
    chunk = field_of(data, "prefill_chunk", int, "engine")
    if not 0 <= tokens <= MAX_SPECULATIVE_TOKENS:
        raise ProtocolError(f"engine.speculative_tokens: {tokens} is not in [0, {MAX_SPECULATIVE_TOKENS}]")
    if batch < 0:
        raise ProtocolError(f"engine.speculative_batch: {batch} is negative")
    if reward not in REWARD_PLACEMENTS:
        raise ProtocolError(f"engine.reward: {reward!r} is not one of {', '.join(REWARD_PLACEMENTS)}")
    if not all(isinstance(d, str) for d in devices) or len(set(devices)) < len(devices):
        raise ProtocolError(f"engine.reward_devices: {devices!r} is not a list of distinct device ids")
    if scale not in ENGINE_SCALES:
        raise ProtocolError(f"engine.engine_scale: {scale} is not one of {', '.join(map(str, ENGINE_SCALES))}")
    if host_kv < 0:
        raise ProtocolError(f"engine.host_kv_tokens: {host_kv} is negative")
    if chunk < 0:
        raise ProtocolError(f"engine.prefill_chunk: {chunk} is negative")
    return EngineSettings(tokens, batch, reward, tuple(devices), scale, host_kv, chunk)


def put_declared(d: Declared) -> dict:
    return {
        "redundant_per_group": d.redundant_per_group,
        "async_ratio": d.async_ratio,
        "partial_rollout": d.partial_rollout,
        "tail_round": d.tail_round,
        "env_prestart": d.env_prestart,
    }


def get_declared(data: Any) -> Declared:
    redundant = field_of(data, "redundant_per_group", int, "declared")
    if redundant < 0:
        raise ProtocolError(f"declared.redundant_per_group: {redundant} is negative")
    async_ratio = data.get("async_ratio")
    if async_ratio is not None and (not isinstance(async_ratio, int) or async_ratio < 0):
        raise ProtocolError(f"declared.async_ratio: expected a non-negative int or null, got {async_ratio!r}")
    tail_round = field_of(data, "tail_round", int, "declared")
    if tail_round < 0:
        raise ProtocolError(f"declared.tail_round: {tail_round} is negative")
    return Declared(
        redundant_per_group=redundant,
        async_ratio=async_ratio,
        partial_rollout=field_of(data, "partial_rollout", bool, "declared"),
        tail_round=tail_round,
        env_prestart=field_of(data, "env_prestart", bool, "declared"),
    )


def put_tokens(frame: Frame, tokens, counts: bool) -> dict:
    """A token sequence: its count on a simulated link, else a typed array."""
    return {"count": len(tokens)} if counts else frame.array(tokens, "i4")


def get_tokens(rx: Received, ref: Any, counts: bool, where: str) -> list[int] | TokenCount:
    if counts:
        count = field_of(ref, "count", int, where)
        if count < 0:
            raise ProtocolError(f"{where}: a negative count")
        return TokenCount(count)
    return rx.ints(ref)


def put_step_result(frame: Frame, r: StepResult, counts: bool) -> dict:
    return {
        "observation": put_tokens(frame, r.observation, counts),
        "reward": r.reward,
        "done": r.done,
        "timed_out": r.timed_out,
        "state_changed": r.state_changed,
        "lost": r.lost,
    }


def get_step_result(rx: Received, d: dict, counts: bool) -> StepResult:
    """Only candidate processes decode a step result (the harness wrote it): no hostile input here."""
    observation = get_tokens(rx, d["observation"], counts, "observation")
    return StepResult(observation, d["reward"], d["done"], d["timed_out"], d["state_changed"], d["lost"])


# -- completions -------------------------------------------------------------------------------------


def put_completion(frame: Frame, c: Completion, counts: bool = False) -> dict:
    """A completion; on a simulated link its count stands for its tokens and their logprobs."""
    fields = {
        "finish_reason": c.finish_reason,
        "weight_version": c.weight_version,
        "device": c.device,
        "queued_s": c.queued_s,
        "cached_tokens": c.cached_tokens,
    }
    if counts:
        return {**fields, "count": len(c.tokens)}
    return {**fields, "tokens": frame.array(c.tokens, "i4"), "logprobs": frame.array(c.logprobs, "f8")}


def get_completion(rx: Received, d: Any, counts: bool = False) -> Completion:
    finish = field_of(d, "finish_reason", str, "completion")
    if finish not in FINISH_REASONS:
        raise ProtocolError(f"completion.finish_reason: {finish!r} is not one of {FINISH_REASONS}")
    if counts:
        tokens = logprobs = get_tokens(rx, d, True, "completion")
    else:
        tokens, logprobs = (
            rx.ints(field_of(d, "tokens", dict, "completion")),
            rx.logprobs(field_of(d, "logprobs", dict, "completion"), "completion").tolist(),
        )
    if len(tokens) != len(logprobs):
        raise ProtocolError(f"completion: {len(tokens)} tokens but {len(logprobs)} logprobs")
    queued = None if d.get("queued_s") is None else field_of(d, "queued_s", float, "completion")
    if queued is not None and queued < 0:
        raise ProtocolError(f"completion.queued_s: {queued} seconds is negative")
    cached = None if d.get("cached_tokens") is None else field_of(d, "cached_tokens", int, "completion")
    if cached is not None and cached < 0:
        raise ProtocolError(f"completion.cached_tokens: {cached} is negative")
    return Completion(
        tokens,
        logprobs,
        finish,
        field_of(d, "weight_version", int, "completion"),
        field_of(d, "device", str, "completion"),
        queued,
        cached,
    )


# -- prompts and trajectories, by reference to the episode's previous prompt ------------------------


class PromptMemory:
    """One side's record of the last prompt sent per episode. Both ends apply the same rules: a
    prompt or a trajectory is sent as ``(prefix, suffix)`` against the episode's last prompt, and a
    trajectory sent for training, or a dropped episode, is forgotten."""

    def __init__(self, counts: bool = False) -> None:
        self.counts = counts
        self._last: dict[str, list[int]] = {}
        self._length: dict[str, int] = {}

    def forget(self, episode: str) -> None:
        self._last.pop(episode, None)
        self._length.pop(episode, None)

    def put(self, frame: Frame, episode: str, tokens: list[int], remember: bool = True) -> dict:
        if self.counts:
            return {"count": len(tokens)}
        last, length = self._last.get(episode, []), self._length.get(episode, 0)
        if tokens is last and len(tokens) >= length:
            prefix = length  # the same list, grown (how an episode's context is kept): no copy, no scan
        elif len(tokens) >= length and tokens[:length] == last[:length]:
            prefix = length
        else:
            limit = min(len(tokens), length)
            differ = np.flatnonzero(np.asarray(tokens[:limit]) != np.asarray(last[:limit]))
            prefix = int(differ[0]) if differ.size else limit
        if remember:
            self._last[episode], self._length[episode] = tokens, len(tokens)
        return {"prefix": prefix, "suffix": frame.array(tokens[prefix:], "i4")}

    def get(self, rx: Received, d: Any, episode: str, remember: bool = True) -> list[int] | TokenCount:
        if self.counts:
            count = field_of(d, "count", int, "tokens")
            if count < 0:
                raise ProtocolError(f"tokens of {episode}: a negative count")
            return TokenCount(count)
        last = self._last.get(episode, [])
        prefix = field_of(d, "prefix", int, "tokens")
        if not 0 <= prefix <= len(last):
            raise ProtocolError(f"tokens of {episode}: prefix {prefix} but the previous prompt has {len(last)} tokens")
        tokens = last[:prefix] + rx.ints(field_of(d, "suffix", dict, "tokens"))
        if remember:
            self._last[episode] = tokens
        return tokens


def put_request(frame: Frame, r: GenerateRequest, memory: PromptMemory) -> dict:
    return {
        "episode_id": r.episode_id,
        "turn": r.turn,
        "prompt": memory.put(frame, r.episode_id, r.prompt),
        "params": put_params(r.params),
        "device": r.device,
        "continues": r.continues,
    }


def _continues(d: Any, prompt_length: int, episode: str) -> int:
    continues = field_of(d, "continues", int, "request")
    if not 0 <= continues < prompt_length:
        raise ProtocolError(
            f"request for {episode}: continues {continues} must be within [0, {prompt_length}) (the prompt's length)"
        )
    return continues


def get_request(rx: Received, d: Any, memory: PromptMemory) -> GenerateRequest:
    episode = field_of(d, "episode_id", str, "request")
    prompt = memory.get(rx, field_of(d, "prompt", dict, "request"), episode)
    if not prompt:
        raise ProtocolError(f"request for {episode}: an empty prompt")
    device = d.get("device")
    if device is not None and not isinstance(device, str):
        raise ProtocolError(f"request for {episode}: device must be a device id or null, got {device!r}")
    return GenerateRequest(
        episode,
        field_of(d, "turn", int, "request"),
        prompt,
        get_params(field_of(d, "params", dict, "request")),
        device,
        _continues(d, len(prompt), episode),
    )


def put_plain_request(frame: Frame, r: GenerateRequest) -> dict:
    """A request with its whole prompt (the harness -> cluster leg: prompts of real runs are short)."""
    return {
        "episode_id": r.episode_id,
        "turn": r.turn,
        "prompt": frame.array(r.prompt, "i4"),
        "params": put_params(r.params),
        "device": r.device,
        "continues": r.continues,
    }


def get_plain_request(rx: Received, d: dict) -> GenerateRequest:
    return GenerateRequest(
        d["episode_id"], d["turn"], rx.ints(d["prompt"]), get_params(d["params"]), d["device"], d["continues"]
    )


def put_aborted(frame: Frame, error: Aborted, counts: bool = False) -> dict:
    """An ``Aborted`` as an error reply, with its partial response when it has one."""
    out = {"type": "Aborted", "message": str(error)[:500], "partial": None}
    if error.partial is not None:
        out["partial"] = put_completion(frame, error.partial, counts)
    return out


def get_aborted(rx: Received, error: dict, counts: bool = False) -> Aborted:
    partial = error.get("partial")
    return Aborted(
        str(error.get("message", ""))[:500],
        None if partial is None else get_completion(rx, field_of(error, "partial", dict, "aborted"), counts),
    )


def put_trajectory(frame: Frame, t: Trajectory, memory: PromptMemory | None) -> dict:
    """Off the loss mask a trajectory's logprobs are 0.0 by the contract: only masked ones travel."""
    fields = {
        "episode_id": t.episode_id,
        "group_id": t.group_id,
        "reward": t.reward,
        "weight_versions": list(t.weight_versions),
        "created_at_step": t.created_at_step,
        "timed_out": t.timed_out,
    }
    if memory is not None and memory.counts:
        memory.forget(t.episode_id)
        return {**fields, "count": len(t.tokens)}
    mask = np.asarray(t.loss_mask, dtype=np.int64)
    if mask.size and (mask.min() < 0 or mask.max() > 1):
        raise ValueError(f"trajectory {t.episode_id}: loss_mask must hold only 0 and 1")
    logprobs = np.asarray(t.logprobs, dtype=np.float64)[mask == 1] if mask.size else []
    tokens = memory.put(frame, t.episode_id, t.tokens, remember=False) if memory else frame.array(t.tokens, "i4")
    if memory:
        memory.forget(t.episode_id)
    return {**fields, "tokens": tokens, "loss_mask": frame.array(mask, "u1"), "logprobs": frame.array(logprobs, "f8")}


def _trajectory(d: Any, episode: str, tokens, loss_mask, logprobs) -> Trajectory:
    try:
        return Trajectory(
            episode,
            field_of(d, "group_id", str, "trajectory"),
            tokens,
            loss_mask,
            logprobs,
            field_of(d, "reward", float, "trajectory"),
            _ints(d, "weight_versions", "trajectory"),
            field_of(d, "created_at_step", int, "trajectory"),
            field_of(d, "timed_out", bool, "trajectory"),
        )
    except ValueError as error:
        raise ProtocolError(str(error)) from None


def get_trajectory(rx: Received, d: Any, memory: PromptMemory | None) -> Trajectory:
    episode = field_of(d, "episode_id", str, "trajectory")
    if memory is not None and memory.counts:
        memory.forget(episode)
        count = TokenCount(field_of(d, "count", int, "trajectory"))
        return _trajectory(d, episode, count, count, count)
    if memory:
        tokens = memory.get(rx, field_of(d, "tokens", dict, "trajectory"), episode, remember=False)
        memory.forget(episode)
    else:
        tokens = rx.ints(field_of(d, "tokens", dict, "trajectory"))
    mask = rx.array(field_of(d, "loss_mask", dict, "trajectory"), "u1")
    if mask.size and mask.max() > 1:
        raise ProtocolError(f"trajectory {episode}: loss_mask must hold only 0 and 1")
    masked = rx.logprobs(field_of(d, "logprobs", dict, "trajectory"), f"trajectory {episode}")
    if len(mask) != len(tokens) or int(mask.sum()) != len(masked):
        raise ProtocolError(
            f"trajectory {episode}: {len(tokens)} tokens, a mask of {len(mask)} with {int(mask.sum())} "
            f"response tokens, and {len(masked)} logprobs"
        )
    logprobs = np.zeros(len(tokens))
    logprobs[mask == 1] = masked
    return _trajectory(d, episode, tokens, mask.astype(np.int64).tolist(), logprobs.tolist())


def put_batch(frame: Frame, batch: TrainBatch, memory: PromptMemory | None = None) -> dict:
    return {
        "trajectories": [put_trajectory(frame, t, memory) for t in batch.trajectories],
        "advantages": list(batch.advantages),
    }


def get_batch(rx: Received, d: Any, memory: PromptMemory | None = None) -> TrainBatch:
    trajectories = [get_trajectory(rx, t, memory) for t in field_of(d, "trajectories", list, "batch")]
    advantages = field_of(d, "advantages", list, "batch")
    if not all(isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) for a in advantages):
        raise ProtocolError("batch.advantages: expected finite numbers")
    try:
        return TrainBatch(trajectories, [float(a) for a in advantages])
    except ValueError as error:
        raise ProtocolError(str(error)) from None


# -- weights -------------------------------------------------------------------------------------------


def put_state(frame: Frame, state: StateDict) -> dict:
    """Weights as safetensors (a format that holds tensors and nothing else), one copy per tensor so
    tied weights (the embedding and the head) serialize."""
    from safetensors.torch import save

    return frame.blob(save({k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}))


def get_state(rx: Received, ref: Any) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(rx.blob(ref))
    except SafetensorError as error:
        raise ProtocolError(f"weights are not a valid safetensors blob: {error}") from None

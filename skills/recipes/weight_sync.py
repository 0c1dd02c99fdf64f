"""Versioned weight sync: the trainer's state is cut into buckets, each put once into Ray's object
store; every engine pulls the buckets (the store broadcasts) and swaps them in under its lock, so
no request is served while its weights change."""

from __future__ import annotations

from targets.api import StateDict

DEFAULT_BUCKET_BYTES = 64 << 20


def to_buckets(state: StateDict, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[dict]:
    buckets: list[dict] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append({})
            size = 0
        buckets[-1][name] = tensor
        size += nbytes
    return buckets


def publish(state: StateDict, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list:
    import ray  # only the Ray cluster publishes; the accuracy checks merge buckets in-process

    return [ray.put(bucket) for bucket in to_buckets(state, bucket_bytes)]


def merge(buckets: list[dict]) -> dict:
    merged: dict = {}
    for bucket in buckets:
        merged.update(bucket)
    return merged

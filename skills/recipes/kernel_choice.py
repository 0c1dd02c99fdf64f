"""Which kernels a paged engine runs where: its attention (FlashInfer's paged kernels, the Triton decode
kernel, or torch SDPA) and whether its layers' elementwise work runs in the fused Triton kernels; each
asked for where it cannot run is an error that says why."""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

ATTENTION_KINDS = ("auto", "flashinfer", "triton", "sdpa")
GRAPHED_ATTENTION = ("flashinfer", "triton")  # the kinds whose decode steps CUDA graphs capture


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _power_of_two(n: int) -> bool:
    return not n & (n - 1)


def _triton_runs_on(device: str) -> bool:
    """A Triton kernel runs on a GPU, or on CPU in Triton's interpreter (``TRITON_INTERPRET=1``, the tests')."""
    return device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1"


def choose_attention(requested: str, device: str, dtype: torch.dtype, head_dim: int = 128, block_size: int = 16) -> str:
    """``auto``: on a GPU in half precision, FlashInfer's paged kernels where FlashInfer is installed,
    else the Triton decode kernel (``triton_attention.py``; the GPU machines lent here have Triton and
    no FlashInfer; its kernel needs a power-of-two head dim and block size); torch SDPA on CPU or in
    float32. The engine's ``attention_kind`` says which ran. Asking for a kind that cannot run here is
    an error that says why."""
    if requested not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, not {requested!r}")
    flashinfer, triton = _installed("flashinfer"), _installed("triton")
    fits_triton = _power_of_two(head_dim) and _power_of_two(block_size)
    if requested == "flashinfer" and not flashinfer:
        raise ValueError("attention='flashinfer' asked for, but FlashInfer is not installed (flashinfer-python)")
    if requested == "triton" and not triton:
        raise ValueError("attention='triton' asked for, but Triton is not installed")
    if requested == "triton" and not fits_triton:
        raise ValueError(f"attention='triton' needs a power-of-two head dim ({head_dim}) and block size ({block_size})")
    if requested == "triton" and not _triton_runs_on(device):
        raise ValueError("attention='triton' needs a GPU device (or TRITON_INTERPRET=1 to interpret it on CPU)")
    if requested != "auto":
        return requested
    if not device.startswith("cuda") or dtype == torch.float32:
        return "sdpa"
    if flashinfer or (triton and fits_triton):
        return "flashinfer" if flashinfer else "triton"
    why = (
        "Triton is not installed"
        if not triton
        else f"head dim {head_dim} or block size {block_size} is no power of two"
    )
    print(  # said: SDPA decode on a GPU runs without CUDA graphs, several times slower a step
        f"attention: torch SDPA on {device}, without CUDA graphs: FlashInfer is not installed and {why}",
        file=sys.stderr,
    )
    return "sdpa"


def choose_fused(requested: bool | None, attention: str, device: str, head_dim: int) -> bool:
    """Whether the layers' elementwise work runs in the Triton kernels of ``fused_ops.py``. ``None``:
    where decode runs a GPU kernel (FlashInfer's or Triton's), whose steps are otherwise a chain of
    tiny torch kernels; never with SDPA (CPU, float32). Asking for them where they cannot run is an
    error that says why."""
    triton, fits = _installed("triton"), _power_of_two(head_dim)
    if requested is None:
        return attention in ("flashinfer", "triton") and triton and fits
    if requested and not (triton and fits):
        raise ValueError(f"fused_kernels needs Triton installed and a power-of-two head dim ({head_dim})")
    if requested and not _triton_runs_on(device):
        raise ValueError("fused_kernels needs a GPU device (or TRITON_INTERPRET=1 to interpret them on CPU)")
    return requested

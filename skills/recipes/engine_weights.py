"""The paged engine's weights: each layer's q/k/v projections stored as one tensor (and its q/k norms,
which one kernel reads), and a dense layer's gate/up projections as another, so a step computes them
in one GEMM each instead of five (a decode step of a small model is a chain of tiny kernels: on the
H200 the 0.6B engine's iteration cost what its ~55 kernels a layer cost, not what its bytes did). The
checkpoint's names stay: each is a row view of its fused tensor, so a weight load by name (in place)
fills the fused tensor, and a state dict read by name is the checkpoint's.

Sleep copies out and frees each *storage* once (a fused tensor, or a plain one; tied embeddings are
one tensor with two names), into host buffers kept from one sleep to the next (pinned on a GPU: one
copy each way, no allocation), and wake points the views at the new memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FUSED = {  # fused name (in the layer) -> the checkpoint's names of its row blocks, in order
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qk_norm.weight": ("self_attn.q_norm.weight", "self_attn.k_norm.weight"),  # one kernel reads both
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


@dataclass
class Storage:
    """One block of weight memory: ``parts`` are its row ranges with the names each goes by (a plain
    tensor: one part covering it, one name, or two when tied)."""

    name: str
    tensor: torch.Tensor
    parts: list[tuple[list[str], int, int]] = field(default_factory=list)  # (names, first row, end row)
    shape: torch.Size = field(default_factory=lambda: torch.Size([]))  # while asleep (the tensor emptied)

    @property
    def fused(self) -> bool:
        return len(self.parts) > 1


class EngineWeights:
    """``named``: the checkpoint's names (views where fused); ``fused``: the fused tensors by layer name
    (``model.layers.{i}.`` and a name of ``FUSED``)."""

    def __init__(self, weights: dict[str, torch.Tensor], layers: int) -> None:
        self.named = weights
        self.fused: dict[str, torch.Tensor] = {}
        self.host: dict[str, torch.Tensor] = {}  # each storage's host copy while it sleeps, kept for the next
        self.on_host = False  # the freed storages' contents are in ``host`` (else discarded)
        owned: set[int] = set()
        self.storages: list[Storage] = []
        for i in range(layers):
            for fused, parts in FUSED.items():
                names = [f"model.layers.{i}.{part}" for part in parts]
                if not all(name in weights for name in names):  # an MoE layer: its experts are fused already
                    continue
                tensor = torch.cat([weights[name] for name in names])
                storage = Storage(f"model.layers.{i}.{fused}", tensor)
                row = 0
                for name in names:
                    rows = weights[name].shape[0]
                    storage.parts.append(([name], row, row + rows))
                    weights[name] = tensor[row : row + rows]  # a view: a load by name writes the fused tensor
                    owned.add(id(weights[name]))
                    row += rows
                self.fused[storage.name] = tensor
                self.storages.append(storage)
        plain: dict[int, Storage] = {}
        for name, tensor in weights.items():
            if id(tensor) in owned:
                continue
            if id(tensor) not in plain:
                plain[id(tensor)] = Storage(name, tensor, [([], 0, tensor.shape[0] if tensor.dim() else 0)])
            plain[id(tensor)].parts[0][0].append(name)
        self.storages += plain.values()

    def copy_to_host(self, pin: bool) -> None:
        """Every storage into its host buffer (allocated on the first sleep only; ``pin``: page-locked,
        the copies asynchronous: synchronize before freeing)."""
        for storage in self.storages:
            if storage.name not in self.host:
                self.host[storage.name] = torch.empty(storage.tensor.shape, dtype=storage.tensor.dtype, pin_memory=pin)
            self.host[storage.name].copy_(storage.tensor, non_blocking=pin)
        self.on_host = True

    def free(self) -> None:
        """Every storage's memory released (its tensors kept, emptied; their shapes remembered)."""
        for storage in self.storages:
            storage.shape = storage.tensor.shape
            empty = torch.empty(0, dtype=storage.tensor.dtype, device=storage.tensor.device)
            storage.tensor.data = empty
            if storage.fused:  # the views hold the old memory too
                for names, _, _ in storage.parts:
                    self.named[names[0]].data = empty

    def allocate(self, device: str) -> None:
        """Memory again for every freed storage, the views pointed into it: the host copies, if the sleep
        made them, else undefined (discarded: a load must fill them)."""
        for storage in self.storages:
            if storage.tensor.numel() or not storage.shape.numel():
                continue
            storage.tensor.data = torch.empty(storage.shape, dtype=storage.tensor.dtype, device=device)
            if self.on_host:
                storage.tensor.data.copy_(self.host[storage.name], non_blocking=True)
            if storage.fused:
                for names, first, end in storage.parts:
                    self.named[names[0]].data = storage.tensor.data[first:end]
        self.on_host = False

    def missing_from(self, state: dict) -> list[str]:
        """Names a load of ``state`` leaves uninitialised after a discard: a part is covered by any of its
        names (tied embeddings by either)."""
        return sorted(names[0] for s in self.storages for names, _, _ in s.parts if not set(names) & set(state))

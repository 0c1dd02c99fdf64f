"""A graphed decode step's integer inputs in one host-to-device copy.

Each decode step needs its token ids, positions, cache slots and (for the Triton kernel) each
sequence's length and block table on the device. Sent one by one from Python lists, that is five
pageable copies a step, each of which waits for the device (a blocking copy synchronizes the stream)
and costs the host tens of microseconds: on a small model whose step is ~1 ms of kernels, the host
work sets the pace. Here they are packed into one host buffer (pinned on a GPU, reused every step)
and sent in one asynchronous copy; the fixed buffers the graphs read are filled from it on the device.
"""

from __future__ import annotations

import torch


class StepUpload:
    def __init__(self, capacity: int, device: str) -> None:
        """``capacity``: the most integers one step sends (the largest graph's inputs)."""
        self.pinned = device.startswith("cuda")
        self.host = torch.empty(capacity, dtype=torch.long, pin_memory=self.pinned)
        self.device = torch.empty(capacity, dtype=torch.long, device=device)
        self.sent = torch.cuda.Event() if self.pinned else None  # the last copy out of ``host`` (none yet: no wait)

    def send(self, values: list[int]) -> torch.Tensor:
        """``values`` on the device (a view of this upload's buffer, valid until the next send)."""
        if len(values) > self.host.numel():
            raise ValueError(f"a step's {len(values)} inputs exceed the upload's {self.host.numel()}")
        if self.sent is not None:
            self.sent.synchronize()  # the host buffer is free again only once the last copy read it
        n = len(values)
        self.host[:n] = torch.tensor(values, dtype=torch.long)
        self.device[:n].copy_(self.host[:n], non_blocking=self.pinned)
        if self.sent is not None:  # on the stream the copy went to: the current one of the buffer's device
            torch.cuda.current_stream(self.device.device).record_event(self.sent)
        return self.device[:n]

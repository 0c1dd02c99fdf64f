"""Peak memory on each GPU during a system run, sampled by the harness itself through NVML: what
the candidate's processes report about themselves is not evidence, and they may be several (an
engine and a trainer rank on one GPU show up here together)."""

from __future__ import annotations

import os
import threading


class DeviceMemoryMonitor:
    """``with DeviceMemoryMonitor(count) as monitor: ...``, then ``monitor.peaks_mb`` maps device
    index to the most memory in use on it at any sample (all processes together)."""

    def __init__(self, count: int, interval_s: float = 0.1) -> None:
        self.count, self.interval_s = count, interval_s
        self.peaks_mb: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None  # a sample that failed in the thread, raised at exit

    def __enter__(self) -> DeviceMemoryMonitor:
        try:
            import pynvml
        except ImportError:
            raise RuntimeError("a GPU target's run samples device memory through NVML: install nvidia-ml-py") from None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        # indices, or UUIDs or their prefixes ("GPU-8f1c", as schedulers often set it): CUDA's syntax
        named = [i.strip() for i in visible.split(",") if i.strip()] if visible else [str(i) for i in range(self.count)]
        if len(named) < self.count:  # checked before NVML starts: a refusal leaves nothing open
            raise RuntimeError(f"CUDA_VISIBLE_DEVICES={visible} shows {len(named)} GPU(s); the target has {self.count}")
        self._nvml = pynvml
        pynvml.nvmlInit()
        try:
            self._handles = [_handle(pynvml, name, visible) for name in named[: self.count]]
        except BaseException:  # a GPU NVML does not know: nothing left open behind the error
            pynvml.nvmlShutdown()
            raise
        self._sample()
        self._thread = threading.Thread(target=self._run, name="device-memory", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        for index, handle in enumerate(self._handles):
            used = self._nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
            self.peaks_mb[index] = max(self.peaks_mb.get(index, 0.0), used)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                self._sample()
        except Exception as error:  # noqa: BLE001 - raised at exit: peaks with a gap would be under-reported
            self._failure = error

    def __exit__(self, kind, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if self._failure is None:
                self._sample()
        finally:
            self._nvml.nvmlShutdown()
        if self._failure is not None and kind is None:  # a run that failed already keeps its own error
            failure = self._failure
            raise RuntimeError(f"sampling device memory through NVML failed mid-run: {failure}") from failure


def _handle(pynvml, name: str, visible: str | None):
    """The GPU a CUDA_VISIBLE_DEVICES entry names: by index, or by a UUID or its prefix, matched against
    every GPU's own (``nvmlDeviceGetHandleByUUID`` takes whole UUIDs only, and as bytes in older bindings)."""
    if name.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(name))
    gpus = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    uuids = [pynvml.nvmlDeviceGetUUID(gpu) for gpu in gpus]
    uuids = [uuid.decode() if isinstance(uuid, bytes) else uuid for uuid in uuids]
    matches = [gpu for gpu, uuid in zip(gpus, uuids, strict=True) if uuid.startswith(name)]
    if len(matches) != 1:
        raise RuntimeError(
            f"CUDA_VISIBLE_DEVICES={visible}: {name!r} names {len(matches)} of this machine's GPUs "
            f"({', '.join(uuids)}); device memory is sampled per whole GPU, by index or UUID"
        )
    return matches[0]

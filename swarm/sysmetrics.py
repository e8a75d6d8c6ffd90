"""GPU memory and utilisation through NVML (nvidia-ml-py), sampled in a background thread.

This replaces the nvidia-smi dumps people keep by hand: the local trainer logs ``sys/gpu_mem_gb`` (memory
in use on the device, as nvidia-smi shows it) and ``sys/gpu_util`` (percent of time a kernel ran) once per
global epoch, and the run's summary keeps the mean utilisation and torch's peak allocated memory.
On a machine without a GPU or without NVML every figure is None, never zero.
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger(__name__)


def _nvml_handle(device: torch.device):
    """The NVML handle of a torch CUDA device (matched by UUID, so CUDA_VISIBLE_DEVICES is respected)."""
    import pynvml

    pynvml.nvmlInit()
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:  # older drivers: fall back to the visible index
        return pynvml.nvmlDeviceGetHandleByIndex(index)


class GpuSampler:
    """Samples one GPU every ``every`` seconds; ``latest()`` and ``mean_util()`` read the results."""

    def __init__(self, device: torch.device, every: float = 1.0) -> None:
        self.device, self.every = device, every
        self.handle = None
        self.samples: list[tuple[float, float]] = []  # (memory used in GB, utilisation in %)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if device.type != "cuda":
            return
        try:
            self.handle = _nvml_handle(device)
        except Exception as exc:  # no driver library, no nvidia-ml-py: figures become n/a
            log.warning("GPU metrics unavailable (NVML: %s); sys/gpu_* will not be logged", exc)

    @property
    def enabled(self) -> bool:
        return self.handle is not None

    def _sample(self) -> None:
        import pynvml

        memory = pynvml.nvmlDeviceGetMemoryInfo(self.handle)
        util = pynvml.nvmlDeviceGetUtilizationRates(self.handle)
        self.samples.append((memory.used / 1e9, float(util.gpu)))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self._sample()
            except Exception:  # a transient NVML error costs one sample
                continue

    def start(self) -> GpuSampler:
        if self.device.type == "cuda":  # the peak counts training only, not the batch-size search before it
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def latest(self) -> tuple[float | None, float | None]:
        """(memory in GB, utilisation in %) of the newest sample, or (None, None)."""
        return self.samples[-1] if self.samples else (None, None)

    def mean_util(self) -> float | None:
        return sum(u for _, u in self.samples) / len(self.samples) if self.samples else None

    def peak_allocated_gb(self) -> float | None:
        """torch's peak allocated memory on the device since start(), in GB (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.device) / 1e9

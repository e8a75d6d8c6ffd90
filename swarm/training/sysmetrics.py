"""GPU memory and utilisation through NVML (nvidia-ml-py), sampled in a background thread; CPU time.

This replaces the nvidia-smi dumps people keep by hand: the local trainer logs ``sys/gpu_mem_gb`` (memory
in use on the device, as nvidia-smi shows it) and ``sys/gpu_util`` (percent of time a kernel ran) once per
global epoch, and the run's summary keeps the mean utilisation and torch's peak allocated memory.
On a machine without a GPU or without NVML every figure is None, never zero.

:class:`CpuMeter` counts the CPU seconds a trainer and its helper processes (DHT, p2p daemon, averagers) use
while it trains, for the benchmark's CPU per sample (a 2-core machine shares its cores between them).
"""

from __future__ import annotations

import logging
import os
import threading
import time

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
            try:  # one sample now: a run shorter than ``every`` still reports its GPU
                self._sample()
            except Exception:
                pass
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


# ---- CPU time, by process ------------------------------------------------------------------------------
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_stat(pid: int) -> tuple[int, float, float] | None:
    """(parent pid, own CPU seconds, reaped children's CPU seconds) of ``pid`` from /proc; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # after the name: state, ppid, ..., utime (14th field of the line), stime, cutime, cstime
    own = (int(fields[11]) + int(fields[12])) / _TICKS
    reaped = (int(fields[13]) + int(fields[14])) / _TICKS
    return int(fields[1]), own, reaped


def cpu_seconds() -> dict[str, float] | None:
    """CPU seconds (user + system, all threads) used so far by this process (``self``) and by its
    descendants (``helpers``: a peer's DHT process and p2p daemon, its averager processes; live ones from
    /proc, exited ones through the times their parents reaped). None where /proc is missing (not Linux)."""
    mine = _proc_stat(os.getpid())
    if mine is None:
        return None
    table: dict[int, tuple[int, float, float]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _proc_stat(int(name))) is not None:
            table[int(name)] = stat
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    helpers, todo = mine[2], list(children.get(os.getpid(), ()))
    while todo:
        pid = todo.pop()
        _, own, reaped = table[pid]
        helpers += own + reaped
        todo += children.get(pid, ())
    return {"self": mine[1], "helpers": helpers}


class CpuMeter:
    """CPU seconds of this process and of its descendants between ``start()`` and ``stop()``, with the wall
    time between them: ``result()`` is ``{"self", "helpers", "wall"}`` (None where /proc is missing)."""

    def __init__(self) -> None:
        self._start: dict[str, float] | None = None
        self._wall = 0.0
        self._result: dict[str, float] | None = None

    def start(self) -> CpuMeter:
        self._start, self._wall = cpu_seconds(), time.monotonic()
        return self

    def stop(self) -> dict[str, float] | None:
        end = cpu_seconds()
        if self._start is not None and end is not None and self._result is None:
            self._result = {k: round(max(0.0, end[k] - self._start[k]), 3) for k in ("self", "helpers")}
            self._result["wall"] = round(time.monotonic() - self._wall, 3)
        return self._result

    def result(self) -> dict[str, float] | None:
        return self._result

"""GPU sampling through NVML (``nvidia-ml-py``, in the ``gpu`` extra): a background thread per
rank reads its own GPU every ``interval`` seconds: utilisation (share of time a kernel ran),
memory-controller utilisation (the share of time device memory was read or written: the
bandwidth figure NVML offers), memory used, power and the SM and memory clocks.

Without a GPU, or without the package or a driver, :func:`start` returns None and a one-line
reason; nothing else changes.
"""
from __future__ import annotations

import threading
import time

import mpirt.core.backend as B

FIELDS = ("gpu_util", "gpu_mem_bw_util", "gpu_mem_used_bytes", "gpu_power_w", "gpu_sm_clock_mhz",
          "gpu_mem_clock_mhz")


class GpuSampler:
    """Samples one NVML device handle from a daemon thread; :meth:`drain` takes them."""

    def __init__(self, nvml, handle, name: str, interval: float = 1.0):
        self.nvml, self.handle, self.name, self.interval = nvml, handle, name, interval
        self.samples: list[tuple[float, dict]] = []  # (perf_counter time, FIELDS values)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpirt-nvml", daemon=True)
        self._thread.start()

    def read(self) -> dict:
        """One sample now."""
        n, h = self.nvml, self.handle
        util = n.nvmlDeviceGetUtilizationRates(h)
        return {"gpu_util": float(util.gpu), "gpu_mem_bw_util": float(util.memory),
                "gpu_mem_used_bytes": float(n.nvmlDeviceGetMemoryInfo(h).used),
                "gpu_power_w": n.nvmlDeviceGetPowerUsage(h) / 1e3,
                "gpu_sm_clock_mhz": float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
                "gpu_mem_clock_mhz": float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM))}

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.perf_counter(), self.read()))
            except self.nvml.NVMLError:  # a query the board does not support: stop quietly
                return
            self._stop.wait(self.interval)

    def drain(self) -> list[tuple[float, dict]]:
        """The samples taken since the last call."""
        out, self.samples = self.samples, []
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval + 1)
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


def mean(samples: list[tuple[float, dict]]) -> dict:
    """Per-field means of ``samples`` (empty when none)."""
    if not samples:
        return {}
    return {k: sum(s[k] for _, s in samples) / len(samples) for k in FIELDS}


def start(interval: float = 1.0) -> tuple[GpuSampler | None, str]:
    """(a sampler of this rank's GPU, a one-line note), or (None, why there is none)."""
    info = B.device_info()
    if info is None:
        return None, "no GPU (CPU run): GPU sampling off"
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install mpirt[gpu]): GPU sampling off"
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(info["pci_bus_id"])
    except pynvml.NVMLError as err:
        return None, f"NVML unavailable ({err}): GPU sampling off"
    return GpuSampler(pynvml, handle, info["name"], interval), f"{info['name']}: NVML every {interval:g} s"

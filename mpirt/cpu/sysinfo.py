"""What the running process has loaded: the shared libraries mapped into it (Linux ``/proc/self/maps``),
and the CPU model it runs on.

Used to find the OpenBLAS behind NumPy (:mod:`mpirt.run.distributed`, thread control) and the MPI
library behind mpi4py (:mod:`mpirt.comm.engines`, CUDA-aware MPI detection) without importing
anything new.
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Callable


def mapped_libraries(match: str | Callable[[str], bool]) -> list[str]:
    """Paths of the files mapped into this process whose file name matches, each once, in map order.

    ``match``: a substring of the file name (case-insensitive), or a predicate on the file name
    (``os.path.basename`` of the path). ``[]`` where ``/proc/self/maps`` cannot be read (not Linux).
    """
    if isinstance(match, str):
        needle = match.lower()

        def match(name: str) -> bool:
            return needle in name.lower()
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                if not fields:
                    continue
                path = fields[-1]
                if match(os.path.basename(path)) and path not in paths:
                    paths.append(path)
    except OSError:
        return []
    return paths


def processors() -> list[dict]:
    """Each processor's fields of ``/proc/cpuinfo``, in order (empty when unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    out, fields = [], {}
    for line in text.splitlines() + [""]:
        if line.strip():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
        elif fields:
            out.append(fields)
            fields = {}
    return out


def cpuinfo() -> dict:
    """The first processor's fields of ``/proc/cpuinfo`` (empty when unreadable)."""
    return next(iter(processors()), {})


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    return cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_seconds() -> tuple[float, float] | None:
    """(busy, total) seconds of all the machine's CPUs since boot, from ``/proc/stat`` (steal
    counts as busy): two readings give the share of the machine that was busy in between. None
    where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    busy = user + nice + system + irq + softirq + steal
    return busy / hz, (busy + idle + iowait) / hz


def cache_dir() -> Path:
    """Where mpirt keeps what it measured or built for this machine (the GEMM verdict, the compiled
    kernels): ``$MPIRT_CACHE``, default ``~/.cache/mpirt``."""
    return Path(os.environ.get("MPIRT_CACHE") or Path.home() / ".cache" / "mpirt")


def read_cache(path: Path) -> dict:
    """A JSON cache file of :func:`cache_dir` as a dict; {} when missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def update_cache(path: Path, key: str, entry) -> None:
    """Set ``key`` to ``entry`` in the JSON cache ``path``; atomic (the ranks of a node may write at
    once: each replaces the file whole). A cache that cannot be written costs a measurement per
    start, nothing else."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = read_cache(path)
        data[key] = entry
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass

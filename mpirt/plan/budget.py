"""The per-rank memory budget a run is checked against before training (``--memory-budget``).

Three settings: an explicit size (``1.5GiB``: refused above it before training, and every rank
stops with exit 5 when a rank's measured peak passes it; on a GPU CuPy's pool is capped at it),
``none`` or ``0`` (no check), and by default ``auto``: what the rank can have, so that a layout
predicted not to fit is refused in one line instead of dying in its first step. On a GPU that is
the device's memory; on a CPU this node's available memory (``MemAvailable`` of
``/proc/meminfo``, or less where the job's cgroup allows less) shared by its ranks, plus what the
rank already holds (its process, not counted as available any more). ``auto`` only refuses
before training: the in-run stop keeps to explicit budgets, since what is available moves with
everything else on the node.

``MPIRT_MEMINFO`` names another file to read instead of ``/proc/meminfo`` (for the tests).
"""
from __future__ import annotations

import os
from pathlib import Path

from mpirt.core.settings import format_size


def _cgroup_room() -> int | None:
    """What this process's cgroup (v2) still lets it take, None without a limit."""
    try:
        cgroup = Path("/proc/self/cgroup").read_text().split("\n")[0].split("::")[-1]
        base = Path("/sys/fs/cgroup") / cgroup.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        stat = dict(line.split() for line in (base / "memory.stat").read_text().splitlines())
        held = int((base / "memory.current").read_text()) - int(stat.get("file", 0))  # the page cache gives way
        return max(0, int(limit) - held)
    except (OSError, ValueError, IndexError):
        return None


def node_available() -> int | None:
    """Bytes the node can still give (MemAvailable, or the cgroup's room where smaller); None
    when neither can be read."""
    meminfo = os.environ.get("MPIRT_MEMINFO") or "/proc/meminfo"
    available = None
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    room = None if os.environ.get("MPIRT_MEMINFO") else _cgroup_room()
    known = [n for n in (available, room) if n is not None]
    return min(known) if known else None


def available_budget(backend: str, local_rank: int, local_size: int) -> tuple[int, str] | None:
    """What this rank can have, in bytes, and where the number comes from (for the refusal's
    line); None when it cannot be told (then nothing is checked). ``backend``: the run's
    (``auto`` means a GPU when CuPy sees one)."""
    import mpirt.core.backend as B

    if backend == "cupy" or (backend == "auto" and B.cupy_available()):
        total = B.device_memory(local_rank)
        return total, f"the GPU's memory, {format_size(total)}"
    available = node_available()
    if available is None:
        return None
    from mpirt.monitor.steps import owned_bytes
    held = owned_bytes()
    share = available // max(local_size, 1)
    return held + share, (f"the node's available memory {format_size(available)} over its {local_size} "
                          f"rank{'s' * (local_size > 1)}, and the {format_size(held)} the rank holds")

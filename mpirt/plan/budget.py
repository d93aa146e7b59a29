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

The check itself (:func:`check_budget`) holds every rank's :func:`mpirt.plan.memory.predict`
against its budget; the training loop's stop reduces :func:`over_budget_flag` over the ranks.

``MPIRT_MEMINFO`` names another file to read instead of ``/proc/meminfo`` (for the tests).
"""
from __future__ import annotations

import os
from pathlib import Path

from mpirt.core.settings import AUTO_BUDGET, explicit_budget, format_size
from mpirt.parallel.layout import AXES, Layout
from mpirt.plan.memory import CATEGORIES, predict


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


def describe_rank(layout, rank: int) -> str:
    """``rank 3 (pp stage 1)``, ``rank 2 (dp 1, tp 0)``: where a rank sits, for messages."""
    sizes = {a: layout.get(a, 1) for a in AXES}
    pos = Layout(**sizes).position(rank)
    where = ", ".join(f"{'pp stage' if a == 'pp' else a} {pos[a]}" for a in AXES if sizes[a] > 1)
    return f"rank {rank}" + (f" ({where})" if where else "")


def check_budget(cfg, model_cfg, layout: dict, world_size: int, data_bytes: int = 0,
                 baselines: list[int] | None = None, available: list | None = None,
                 host_heap: bool = False) -> list[dict]:
    """Every rank's :func:`mpirt.plan.memory.predict` (``baselines``: each rank's
    :func:`~mpirt.plan.memory.measured_baseline`, else :data:`~mpirt.plan.memory.PROCESS_BYTES`;
    ``host_heap`` as there); ValueError for the rank whose peak exceeds its
    budget by the most, naming its largest term, the numbers and what would shrink it. The budget: an explicit
    ``cfg.memory_budget``, or under ``auto`` each rank's ``available`` entry (``(bytes, where
    from)`` of :func:`available_budget`; None: unknown, unchecked)."""
    preds = [predict(cfg, model_cfg, layout, r, data_bytes, process_bytes=baselines[r] if baselines else None,
                     host_heap=host_heap) for r in range(world_size)]
    explicit = explicit_budget(cfg.memory_budget)
    if explicit is not None:
        limits = [(explicit, None)] * world_size
    elif cfg.memory_budget.strip().lower() == AUTO_BUDGET and available:
        limits = available
    else:
        return preds
    checked = [r for r in range(world_size) if limits[r] is not None]
    if not checked:
        return preds
    worst = max(checked, key=lambda r: preds[r]["peak"] - limits[r][0])
    p = preds[worst]
    budget, source = limits[worst]
    if p["peak"] <= budget:
        return preds
    term = max(CATEGORIES, key=lambda k: p[k])
    zero_hint = {k: f"--zero {z} or a larger pp or tp" if cfg.zero < z and not (z == 3 and layout["pp"] > 1)
                 else "a larger pp or tp" for k, z in (("optimizer_state", 1), ("gradients", 2), ("parameters", 3))}
    hints = {**zero_hint,
             "activations": "--recompute selective/full, a smaller --batch-size or more --microbatches",
             "communication": "a larger pp or tp (smaller stages and units)",
             "workspace": "a larger tp or pp (smaller logits and tensors)",
             "baseline": "a larger budget: the process alone needs it",
             "data": "a larger budget: the dataset bytes held in memory"}
    over = f"budget {format_size(budget)}" if source is None else \
        f"the {format_size(budget)} it can have ({source}; --memory-budget SIZE sets a budget, none checks none)"
    raise ValueError(f"memory_budget: {describe_rank(layout, worst)}: predicted peak {format_size(p['peak'])} > "
                     f"{over}; largest term {term.replace('_', ' ')} {format_size(p[term])} "
                     f"({', '.join(f'{k.replace(chr(95), chr(32))} {format_size(p[k])}' for k in CATEGORIES)}); "
                     f"try {hints[term]}")


def over_budget_flag(peak: int, budget: int | None, rank: int) -> int:
    """This rank's entry in the training loop's per-step max-reduction: 0 within ``budget``, else
    the peak (KiB) and the rank packed into one int64, so the maximum over ranks names the
    largest peak over the budget and its rank (:func:`decode_over_budget`)."""
    return 0 if budget is None or peak <= budget else (peak // 1024) << 20 | rank


def decode_over_budget(flag: int) -> tuple[int, int]:
    """``(rank, peak bytes)`` of a nonzero :func:`over_budget_flag`."""
    return int(flag) & (2**20 - 1), (int(flag) >> 20) * 1024

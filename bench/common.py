"""What every benchmark here shares, so that its figures can be trusted on a shared machine.

- :class:`LoadMonitor`: the machine's load before and after a run (``/proc/loadavg``) and, over
  the run, the share of the machine's CPU time that *other* processes took (``/proc/stat`` busy
  time, steal included, minus this benchmark's own CPU time: ``os.times`` of each rank, summed by
  the caller under MPI).
- :func:`verdict`: the warning rule. Figures are unreliable when others took more than
  ``OTHERS_MAX`` of the machine during the run, or the 1-minute load before it was above
  ``LOAD_MAX`` per core: a contender that suffers more from oversubscription (a spinning thread
  pool) then looks worse than it is (issue 13: 4-10x under load against 0.74-1.21x quiet).
- :func:`wait_for_quiet`: poll the load before starting (``--quiet-wait`` seconds at most).
- :func:`alternate`: contenders take turns step by step (order rotating each round), never
  block by block, so that background load hits them alike; per-round times give the spread.
  Under MPI each round's time is the slowest rank's (:func:`slowest_rank`).
- :func:`spread`, :func:`paired_ratio`: min/median/max of times and of per-round ratios.
- :func:`write_results`: ``bench/results/NAME.json`` (everything) and ``NAME.md`` (the table,
  the machine, the load and the verdict). ``bench/results/`` is ignored by git except the
  ``*.md`` tables that docs cite.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mpirt.cpu.sysinfo import cpu_model, cpu_seconds

RESULTS = Path(__file__).resolve().parent / "results"
OTHERS_MAX = 0.10     # share of the machine's CPU time other processes may take during a run
LOAD_MAX = 0.5        # 1-minute load average per core before a run


def cores() -> int:
    """CPUs this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def loadavg() -> list[float]:
    """The 1-, 5- and 15-minute load averages."""
    return list(os.getloadavg())


def own_cpu_seconds() -> float:
    """CPU seconds this process has used (all its threads)."""
    t = os.times()
    return t.user + t.system


@dataclass
class LoadMonitor:
    """Machine load around a run: ``start()`` before, ``stop(own)`` after (``own``: the CPU
    seconds the benchmark's processes used in between; default this process's own)."""

    before: list = field(default_factory=list)
    after: list = field(default_factory=list)
    others_share: float | None = None      # fraction of all cores' time taken by other processes
    machine_share: float | None = None     # fraction of all cores' time busy (everyone)
    wall_s: float = 0.0
    _t0: tuple = ()

    def start(self) -> "LoadMonitor":
        self.before = loadavg()
        self._t0 = (time.perf_counter(), cpu_seconds(), own_cpu_seconds())
        return self

    def own_since_start(self) -> float:
        """This process's CPU seconds since :meth:`start` (to sum over ranks before :meth:`stop`)."""
        return own_cpu_seconds() - self._t0[2]

    def stop(self, own: float | None = None) -> "LoadMonitor":
        t0, seconds0, _ = self._t0
        self.wall_s = time.perf_counter() - t0
        self.after = loadavg()
        own = self.own_since_start() if own is None else own
        now = cpu_seconds()
        if seconds0 is not None and now is not None:
            busy, total = (b - a for a, b in zip(seconds0, now))
            capacity = total or self.wall_s * cores()
            self.machine_share = busy / capacity if capacity else 0.0
            self.others_share = max(0.0, busy - own) / capacity if capacity else 0.0
        return self

    def as_dict(self) -> dict:
        return {"loadavg_before": self.before, "loadavg_after": self.after, "wall_s": self.wall_s,
                "others_cpu_share": self.others_share, "machine_cpu_share": self.machine_share,
                "cores": cores()}


def verdict(load: LoadMonitor) -> tuple[bool, str]:
    """(reliable, one line saying why or why not) by the rule in the module docstring."""
    n = cores()
    problems = []
    if load.before and load.before[0] > LOAD_MAX * n:
        problems.append(f"1-min load {load.before[0]:.2f} before the run (> {LOAD_MAX * n:.1f} on {n} cores)")
    if load.others_share is not None and load.others_share > OTHERS_MAX:
        problems.append(f"other processes took {100 * load.others_share:.0f}% of the CPU time during the run "
                        f"(> {100 * OTHERS_MAX:.0f}%)")
    if problems:
        return False, "UNRELIABLE: " + "; ".join(problems) + ": rerun on a quiet machine"
    share = "unknown" if load.others_share is None else f"{100 * load.others_share:.0f}%"
    return True, f"quiet: 1-min load {load.before[0]:.2f} before, {load.after[0]:.2f} after; others' CPU share {share}"


def load_line(load: LoadMonitor) -> str:
    """The load figures in one line."""
    others = "n/a" if load.others_share is None else f"{100 * load.others_share:.0f}%"
    return (f"load avg before {'/'.join(f'{x:.2f}' for x in load.before)}, after "
            f"{'/'.join(f'{x:.2f}' for x in load.after)} (1/5/15 min, {cores()} cores); "
            f"CPU time taken by other processes during the run: {others}")


def wait_for_quiet(max_wait_s: float, threshold: float | None = None, poll_s: float = 5.0) -> float:
    """Sleep until the 1-minute load is below ``threshold`` (default ``LOAD_MAX`` per core), at
    most ``max_wait_s``; returns the load at the end (the run then goes on either way)."""
    threshold = LOAD_MAX * cores() if threshold is None else threshold
    deadline = time.monotonic() + max_wait_s
    while loadavg()[0] > threshold and time.monotonic() < deadline:
        time.sleep(poll_s)
    return loadavg()[0]


def alternate(contenders: dict, repeats: int, warmup: int = 1, before=None,
              clock=time.perf_counter) -> dict[str, list[float]]:
    """Seconds per call of each zero-argument function in ``contenders``, taking turns step by
    step: each round calls every contender once, the order rotating by one each round (the same
    order on every MPI rank). ``warmup`` untimed rounds first. ``before`` (untimed) runs before
    each call: a barrier under MPI, or a short sleep so that a thread pool spinning after its
    last call does not steal the next contender's cores."""
    names = list(contenders)
    times = {n: [] for n in names}
    for r in range(warmup + repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if before is not None:
                before()
            t0 = clock()
            contenders[name]()
            dt = clock() - t0
            if r >= warmup:
                times[name].append(dt)
    return times


def slowest_rank(times: dict[str, list[float]], comm) -> dict[str, list[float]]:
    """Per call, the slowest rank's seconds (an mpi4py communicator; calls started together end
    when the last rank ends)."""
    import numpy as np
    from mpi4py import MPI
    out = {}
    for name, values in times.items():
        v = np.asarray(values, dtype=np.float64)
        comm.Allreduce(MPI.IN_PLACE, v, op=MPI.MAX)
        out[name] = v.tolist()
    return out


def spread(values) -> dict:
    """min, median and max of ``values``, and their count."""
    v = list(values)
    return {"min": min(v), "median": statistics.median(v), "max": max(v), "n": len(v)}


def paired_ratio(num, den) -> dict:
    """Spread of the per-round ratios ``num[i] / den[i]`` (rounds of :func:`alternate`) and the
    ratio of the medians."""
    out = spread(a / b for a, b in zip(num, den))
    out["of_medians"] = statistics.median(num) / statistics.median(den)
    return out


def fmt_spread(s: dict, scale: float = 1e3, digits: int = 1) -> str:
    """``median [min-max]`` of a :func:`spread`, times ``scale`` (default: seconds as ms)."""
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'] * scale)} [{f.format(s['min'] * scale)}-{f.format(s['max'] * scale)}]"


def fmt_ratio(s: dict) -> str:
    """``median [min-max]`` of a :func:`paired_ratio`."""
    return fmt_spread(s, 1.0, 2)


def launch(cmd: list[str], ranks: int, timeout: float, check: bool = True):
    """Run ``python -m CMD...`` from the repository root (under mpiexec when ranks > 1, one BLAS
    thread per rank); returns (the result, its wall seconds, the largest peak RSS of a child
    process in bytes: ru_maxrss of the children waited for). ``check``: a failing run ends the
    benchmark with its output."""
    full = [sys.executable, "-m", *cmd]
    if ranks > 1:
        full = ["mpiexec", "-n", str(ranks), *full]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    result = subprocess.run(full, capture_output=True, text=True, timeout=timeout, env=env,
                            cwd=Path(__file__).resolve().parents[1])
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    if check and result.returncode != 0:
        sys.exit(f"{' '.join(full)} exited {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result, wall, peak


def workspace(out: str, data: str, prefix: str) -> tuple[Path, str]:
    """``(the runs' directory, the dataset)`` of a benchmark launching training runs: ``out`` (else a
    new temporary directory named ``prefix``...) and ``data`` (else this repository's sources,
    prepared byte-level into the runs' directory once)."""
    import tempfile
    root = Path(out or tempfile.mkdtemp(prefix=prefix))
    root.mkdir(parents=True, exist_ok=True)
    if not data:
        data = str(root / "data")
        if not (Path(data) / "meta.json").exists():
            from mpirt.data.tokens import prepare
            prepare(Path(__file__).resolve().parents[1] / "mpirt", Path(data), pattern="*.py", val_fraction=0.2)
    return root, data


def children_cpu_s() -> float:
    """CPU seconds of the child processes waited for so far (the runs a benchmark launched)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header: list[str], rows: list[list]) -> str:
    """The same table in aligned plain text, for the terminal."""
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in cells)


def machine() -> dict:
    """Host, CPU model, cores and Python, for the results."""
    cpu = cpu_model()
    return {"host": platform.node(), "cpu": cpu, "cores": cores(), "python": platform.python_version()}


def write_results(name: str, title: str, header: list[str], rows: list[list], load: LoadMonitor,
                  data: dict, notes: list[str] = (), directory: Path | None = None,
                  save: bool = True) -> tuple[bool, str]:
    """Print the table and the load verdict; with ``save``, write ``NAME.json`` (``data`` plus
    machine and load) and ``NAME.md`` under ``directory`` (default ``bench/results``, whose .md
    tables are tracked: a benchmark may leave them alone unless asked). Returns :func:`verdict`."""
    ok, why = verdict(load)
    info = machine()
    command = "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    print(f"{title}\n{text_table(header, rows)}")
    for line in notes:
        print(line)
    print(load_line(load))
    print(("" if ok else "WARNING: ") + why, file=sys.stdout if ok else sys.stderr)
    if not save:
        return ok, why
    directory = Path(directory or RESULTS)
    directory.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    md = [f"# {title}", "", markdown_table(header, rows), ""]
    md += [f"{line}  " for line in notes]
    md += ["", f"- machine: {info['cpu']}, {info['cores']} cores, Python {info['python']}",
           f"- {load_line(load)}", f"- verdict: {why}", f"- command: `{command}`", f"- taken: {stamp}", ""]
    (directory / f"{name}.md").write_text("\n".join(md))
    payload = {"title": title, "machine": info, "load": load.as_dict(), "reliable": ok, "verdict": why,
               "command": command, "taken": stamp, **data}
    (directory / f"{name}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    print(f"wrote {directory / name}.md and .json", file=sys.stderr)
    return ok, why

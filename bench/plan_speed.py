"""How long the planner's search takes at the shapes people train, against the planner of an
earlier commit (default 01ad272, before the search pruned by memory and stopped recomputing
model constants), side by side in one run.

    python bench/plan_speed.py [--baseline REV] [--repeats 3] [--baseline-timeout 300]

Each case is `python -m mpirt.plan ... --json` in a fresh process (CPU seconds of the child and
wall seconds), contenders alternating round by round; the baseline runs from a temporary git
worktree of REV. Where both finish, the two top-10 lists are compared layout by layout. Writes
bench/results/plan_speed.md with the machine load (bench/common.py's rule).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import LoadMonitor, fmt_spread, spread, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _case(model: str, fields: str, nodes: int, gpu: str, batch: int, seq: int) -> list:
    """The planner's arguments (``--model-override`` once per field: the baseline takes one each)."""
    overrides = [arg for f in fields.split() for arg in ("--model-override", f)]
    return ["--model", model, *overrides, "--nodes", str(nodes), "--gpus-per-node", "8", "--gpu", gpu,
            "--global-batch", str(batch), "--seq-len", str(seq)]


# name: (the planner's arguments, target seconds on this 2-core machine)
CASES = {
    "GPT-3 175B on 64 A100": (_case("gpt2", "n_layer=96 n_embd=12288 n_head=96 vocab_size=51200 n_positions=2048",
                                    8, "a100", 64, 2048), 10),
    "Mixtral 8x22B on 128 H100": (_case("mixtral-tiny", "n_layer=56 n_embd=6144 n_head=48 n_kv_head=8 n_inner=16384 "
                                        "n_expert=8 vocab_size=32768 n_positions=4096", 16, "h100", 256, 4096), 10),
    "Llama 3 405B on 16384 H100": (_case("llama-tiny", "n_layer=126 n_embd=16384 n_head=128 n_kv_head=8 "
                                          "n_inner=53248 vocab_size=128256 n_positions=8192", 2048, "h100", 2048,
                                          8192), 60),
}


def baseline_tree(rev: str, where: Path) -> Path:
    """A worktree of ``rev`` under ``where`` whose ``mpirt.models`` imports from its own models/
    (the package maps that folder in at install time; a symlink does it for a plain path)."""
    tree = where / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True,
                   capture_output=True)
    (tree / "mpirt" / "models").symlink_to(tree / "models")
    return tree


def run_plan(tree: Path, args: list, timeout: float, out_json: Path) -> dict:
    """One planner run from ``tree``: its CPU and wall seconds, exit code and ranked layouts."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-m", "mpirt.plan", *args, "--json", str(out_json)], cwd=tree, env=env,
                           capture_output=True, text=True, timeout=timeout)
        code, tail = r.returncode, (r.stdout + r.stderr).strip().splitlines()[:1]
    except subprocess.TimeoutExpired:
        code, tail = None, [f"did not finish in {timeout:.0f} s"]
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    layouts = json.loads(out_json.read_text()) if code == 0 and out_json.exists() else []
    return {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "exit": code, "first_line": tail[0] if tail else "", "top10": [_key(e) for e in layouts[:10]]}


def _key(est: dict) -> str:
    lay = est["layout"]
    return " ".join(f"{k}={lay.get(k)}" for k in ("dp", "ep", "tp", "cp", "pp", "schedule", "chunks", "microbatches",
                                                   "rows_per_microbatch", "sequence_parallel", "zero", "recompute"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="01ad272", help="the commit whose planner is the other contender")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline-timeout", type=float, default=300.0)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    ap.add_argument("--note", action="append", default=[], help="a line for the results' notes (repeatable): "
                    "e.g. what changed in the step-time model between the two contenders")
    a = ap.parse_args()
    load = LoadMonitor().start()
    rows, record = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = baseline_tree(a.baseline, tmp)
        try:
            for name in a.cases.split(","):
                args, target = CASES[name]
                runs = {"this tree": [], a.baseline: []}
                for r in range(a.repeats):  # alternating; the baseline once when it cannot finish in time
                    order = [("this tree", ROOT), (a.baseline, base)]
                    for who, tree in order if r % 2 == 0 else order[::-1]:
                        if who == a.baseline and runs[who] and runs[who][-1]["exit"] != 0:
                            continue
                        runs[who].append(run_plan(tree, args, a.baseline_timeout, tmp / f"{len(rows)}-{who[:4]}.json"))
                record[name] = runs
                new, old = runs["this tree"], runs[a.baseline]
                cpu = spread(x["cpu_s"] for x in new)
                old_ok = [x for x in old if x["exit"] == 0]
                old_txt = fmt_spread(spread(x["cpu_s"] for x in old_ok), 1.0, 1) if old_ok else \
                    f"no plan: {old[0]['first_line']}"
                same = ("yes" if old_ok[0]["top10"] == new[0]["top10"] else "no") if old_ok else "-"
                rows.append([name, fmt_spread(cpu, 1.0, 1), fmt_spread(spread(x["wall_s"] for x in new), 1.0, 1),
                             str(target), old_txt, same, new[0]["first_line"].split(": ")[-1]])
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], capture_output=True)
    own = sum(x["cpu_s"] for runs in record.values() for side in runs.values() for x in side)
    load.stop(own=own)  # the planners' child processes are this benchmark's own CPU time
    write_results("plan_speed", "Planner search time at the shapes people train",
                  ["case", "this tree CPU s", "this tree wall s", "target s", f"{a.baseline} CPU s", "same top 10",
                   "feasible of tried"], rows, load, {"cases": record},
                  notes=[f"{a.repeats} runs of each, alternating with the planner of {a.baseline}; CPU seconds of "
                         "the planner's process (median [min-max]); a baseline that did not finish in "
                         f"{a.baseline_timeout:.0f} s runs once.", *a.note])


if __name__ == "__main__":
    main()

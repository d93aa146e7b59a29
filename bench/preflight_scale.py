"""The pre-flight proof at the largest layouts: what one rank spends on it, time and memory.

    python bench/preflight_scale.py                 # the cases below, the proof before issue 34 up to 16,384 ranks
    python bench/preflight_scale.py --before none   # the current proof only

Each case runs in a fresh process (its peak RSS is the proof's and the interpreter's) and does
what every rank does before its first step: resolve the layout with the model, prove the step's
communication (``mpirt.parallel.preflight.check_step`` for the world's last rank, the farthest
from the stages' representatives) and check the pipeline's training and evaluation schedules
(``mpirt.parallel.pipeline.check.check``, as each stage does when it is built). ``--before REV``
runs the same with ``mpirt/parallel/preflight.py`` as it was at git revision ``REV`` (every rank
of the proof's grid simulated), for the cases of at most ``--before-max-ranks`` ranks: the larger
ones took 8.5 to 14 GiB on every rank then (issue 34), too much for a shared machine.
Writes ``bench/results/preflight_scale.{md,json}``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from common import LoadMonitor, children_cpu_s, write_results  # noqa: E402

SEQ = 2048
# name: (dp, tp, pp, cp, schedule, chunks, microbatches)
CASES = {
    "16,384: dp 8 x tp 8 x pp 16 x cp 16, interleaved x2, 16 mb": (8, 8, 16, 16, "interleaved", 2, 16),
    "1,024: pp 64 x cp 16, 1f1b, 256 mb": (1, 1, 64, 16, "1f1b", 1, 256),
    "65,536: dp 4 x tp 8 x pp 64 x cp 32, 1f1b, 64 mb": (4, 8, 64, 32, "1f1b", 1, 64),
    "65,536: dp 4 x tp 8 x pp 64 x cp 32, interleaved x2, 64 mb": (4, 8, 64, 32, "interleaved", 2, 64),
}
# what the issue measured with the proof before it (every rank the same)
ISSUE = {"16,384: dp 8 x tp 8 x pp 16 x cp 16, interleaved x2, 16 mb": "18 s, 0.31 GiB",
         "1,024: pp 64 x cp 16, 1f1b, 256 mb": "> 600 s (unfinished), 8.5 GiB",
         "65,536: dp 4 x tp 8 x pp 64 x cp 32, 1f1b, 64 mb": "14 GiB reached"}


def prove(case: str, before: str | None) -> dict:
    """One rank's pre-flight work for ``case`` (in this process): seconds, CPU seconds, peak RSS."""
    from mpirt.core.modeling import load_model_config
    from mpirt.parallel.layout import Layout
    from mpirt.parallel.pipeline.check import check
    from mpirt.run.config import TrainConfig

    if before:
        spec = importlib.util.spec_from_file_location("preflight_before", before)
        preflight = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
        spec.loader.exec_module(preflight)
    else:
        from mpirt.parallel import preflight
    dp, tp, pp, cp, schedule, chunks, m = CASES[case]
    world = dp * tp * pp * cp
    model = load_model_config("tiny", {"n_layer": pp * chunks, "n_head": 8, "n_embd": 256, "n_positions": SEQ})
    cfg = replace(TrainConfig(), tp=tp, pp=pp, cp=cp, batch_size=dp * m, seq_len=SEQ, microbatches=m,
                  schedule=schedule, chunks=chunks)
    t0 = time.perf_counter()
    layout = Layout.of(cfg, Layout.resolve(cfg, world), model)
    if before:
        preflight.check_step(layout, model, SEQ, "float32")
    else:
        preflight.check_step(layout, model, "float32", rank=world - 1)
    check(layout.pipeline_schedule)
    check(layout.pipeline_schedule.forward_only())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds": time.perf_counter() - t0, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_gib": usage.ru_maxrss / 2**20}


def run_case(case: str, before: str | None, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--one", case] + (["--source", before] if before else [])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"> {timeout:.0f} s (stopped)"}
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def source_at(rev: str, into: Path) -> str | None:
    """``mpirt/parallel/preflight.py`` at git revision ``rev``, written under ``into``."""
    done = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:mpirt/parallel/preflight.py"],
                          capture_output=True, text=True)
    if done.returncode:
        print(f"--before {rev}: {done.stderr.strip()}; the earlier proof is left out", file=sys.stderr)
        return None
    path = into / "preflight_before.py"
    path.write_text(done.stdout)
    return str(path)


def cell(result: dict) -> str:
    if "error" in result:
        return result["error"]
    return f"{result['seconds']:.2f} s ({result['cpu_s']:.2f} s CPU), {result['peak_gib']:.2f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="67f2937",
                    help="git revision of the earlier proof to run beside it ('none': leave it out)")
    ap.add_argument("--before-max-ranks", type=int, default=16384)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per case and proof")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--source", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(prove(a.one, a.source)))
        return
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    load = LoadMonitor().start()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        before = None if a.before == "none" else source_at(a.before, Path(tmp))
        for case, (dp, tp, pp, cp, *_rest) in CASES.items():
            now = run_case(case, None, a.timeout)
            then = run_case(case, before, a.timeout) if before and dp * tp * pp * cp <= a.before_max_ranks else None
            results[case] = {"now": now, "before": then}
            print(f"{case}: now {cell(now)}" + (f"; before {cell(then)}" if then else ""), file=sys.stderr)
    load.stop(own=children_cpu_s())
    uptime_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    rows = [[case, cell(r["now"]), cell(r["before"]) if r["before"] else "not run", ISSUE.get(case, "")]
            for case, r in results.items()]
    write_results("preflight_scale", "Pre-flight proof per rank at the largest layouts (seconds, peak RSS)",
                  ["layout (ranks)", "now: per rank", f"before ({a.before}), run here", "before, issue 34's numbers"],
                  rows, load, {"results": results, "uptime_before": uptime, "uptime_after": uptime_after},
                  notes=[f"Each rank proves its own program against its stage's and simulates one rank per stage; "
                         f"model tiny with n_layer = pp x chunks, n_head 8, seq_len {SEQ}, float32.",
                         f"uptime before: {uptime}", f"uptime after: {uptime_after}"])


if __name__ == "__main__":
    main()

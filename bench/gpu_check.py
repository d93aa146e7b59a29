"""The parts of ``bench/gpu_check.sh``: mpirt on one GPU (CuPy) checked against NumPy float64 and timed
beside PyTorch, in one call of a few minutes on a lent H200. Each part is a function run in its own
process (the shell gives each a timeout and goes on when one fails) and writes ``WORK/PART.json``:
rows of the results table ``[section, check, result, verdict]`` plus its raw data; ``report``
joins them into ``bench/results/gpu-<date>.md`` (and ``.json``) through bench/common.py's writer.

    python bench/gpu_check.py PART --work DIR [--cpu]
    python bench/gpu_check.py report --work DIR --out-dir DIR --name NAME [--cpu]

Parts: ``env`` (versions, the GPU, NCCL, torch, mpi4py and an MPI library), ``ops`` and ``optim``
and ``gpt`` (:mod:`gpu_check_correct`: every exported op forward and backward, AdamW, a full GPT
step on CuPy float64/float32/bfloat16 against NumPy float64), ``matmul``, ``allreduce``,
``train-350m-mpirt``, ``train-350m-torch``, ``train-1.3b-mpirt``, ``train-1.3b-torch``, ``attention``
(the CUDA flash attention against torch's SDPA) and ``profile`` (the 1.3B step's time per op)
(:mod:`gpu_check_perf`), and ``nvml``, the NVML sampler (:mod:`mpirt.monitor.gpu`) that runs beside the
others until ``WORK/nvml.stop`` appears; the report gives its means over each part's timed window.

``--cpu`` (the dry run): the same code paths on NumPy with tiny shapes (CuPy replaced by NumPy
wherever the check would use it, PyTorch on the CPU); its figures mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

H200_BF16_PEAK = 989e12   # dense bf16 FLOP/s of an H200 SXM (data sheet; mpirt.monitor.flops.GPU_PEAKS)
SECTIONS = ("env", "ops", "optim", "gpt-step", "matmul", "attention", "allreduce", "train", "profile", "nvml",
            "parts")
SECTION_OF = {"env": "env", "ops": "ops", "optim": "optim", "gpt": "gpt-step", "matmul": "matmul",
              "allreduce": "allreduce", "attention": "attention",
              "profile": "profile", "nvml": "nvml"}
TRAIN_PARTS = tuple(f"train-{m}-{f}" for m in ("350m", "1.3b") for f in ("mpirt", "torch"))


def section_of(part: str) -> str:
    return "train" if part.startswith("train-") else SECTION_OF.get(part, part)


def ensure_models() -> None:
    """Make ``mpirt.models`` importable where mpirt is not pip-installed (the lent GPU machine gets
    a copy of the tree and installs nothing): pip maps the folder models/ to that name through
    ``package-dir``; here the same folder is registered under that name by hand."""
    import importlib.util

    import mpirt
    try:
        import mpirt.models  # noqa: F401
        return
    except ModuleNotFoundError as err:
        if err.name != "mpirt.models":
            raise
    spec = importlib.util.spec_from_file_location("mpirt.models", ROOT / "models" / "__init__.py",
                                                  submodule_search_locations=[str(ROOT / "models")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["mpirt.models"] = module
    spec.loader.exec_module(module)
    mpirt.models = module


def select(cpu: bool) -> str:
    """The backend the checks run on: CuPy (the GPU run) or NumPy (``--cpu``)."""
    import mpirt.core.backend as B
    return B.select("numpy" if cpu else "cupy")


def device_name(cpu: bool) -> str:
    import mpirt.core.backend as B
    info = B.device_info()
    return info["name"] if info else ("CPU (dry run)" if cpu else "?")


def sync() -> None:
    import mpirt.core.backend as B
    B.synchronize()


def rel_err(got, ref) -> float:
    """``||got - ref|| / ||ref||`` in float64 (the absolute norm where ``ref`` is all zeros);
    infinite for a shape mismatch or a non-finite value (NaN never passes)."""
    got = np.asarray(got).astype(np.float64)
    ref = np.asarray(ref).astype(np.float64)
    if got.shape != ref.shape or not np.isfinite(got).all():
        return float("inf")
    diff, norm = float(np.linalg.norm((got - ref).ravel())), float(np.linalg.norm(ref.ravel()))
    return diff / norm if norm > 0 else diff


def fmt_err(e: float) -> str:
    return "inf" if not np.isfinite(e) else f"{e:.1e}"


def verdict(ok) -> str:
    return "ok" if ok else "FAIL"


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def short_error(err: BaseException) -> str:
    """The exception's first line, unprintable characters escaped (a table row stays text)."""
    line = (str(err).strip().splitlines() or [""])[0]
    line = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in line)
    return f"{type(err).__name__}: {line}"[:160]


def save(work: Path, part: str, rows: list, data: dict, t0: float, **extra) -> None:
    payload = {"part": part, "rows": rows, "data": data, "t0": t0, "t1": time.time(), **extra}
    (work / f"{part}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")


# --- env ----------------------------------------------------------------------------------------------
def _mpi_probe() -> tuple[bool, str]:
    """Whether ``from mpi4py import MPI`` loads an MPI library (in a child: a failed load can abort)."""
    # (Open MPI's version string ends in a NUL)
    code = "from mpi4py import MPI; print(MPI.Get_library_version().replace(chr(0), '').strip().splitlines()[0])"
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return False, "importing mpi4py.MPI hung for 60 s"
    if r.returncode == 0:
        return True, r.stdout.strip()
    lines = [x for x in (r.stderr or r.stdout).strip().splitlines() if x.strip()]
    return False, " / ".join(lines[-2:])[:200]


def part_env(args) -> None:
    t0, rows, data = time.time(), [], {}

    def row(check, result, ok=True):
        rows.append(["env", check, result, ok if isinstance(ok, str) else verdict(ok)])
        data[check] = result

    import ml_dtypes
    row("python", f"{platform.python_version()} ({sys.executable})")
    row("numpy / ml_dtypes", f"{np.__version__} / {ml_dtypes.__version__}")
    data["loadavg"] = list(os.getloadavg())
    try:
        import cupy
        try:
            cuda = cupy.cuda.runtime
            props = cuda.getDeviceProperties(0)
            name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
            free, total = cupy.cuda.Device(0).mem_info
            row("cupy", f"{cupy.__version__}; {cuda.getDeviceCount()} GPU(s), {name}, cc {props['major']}.{props['minor']}, "
                        f"{gib(total)} ({gib(free)} free); CUDA runtime {cuda.runtimeGetVersion()}, driver {cuda.driverGetVersion()}",
                not args.cpu or "n/a")
            try:
                a = cupy.asarray(np.ones((64, 64), dtype=ml_dtypes.bfloat16))
                dot = float((a @ a)[0, 0].astype(cupy.float32))
                total = float((a * 2).sum().astype(cupy.float32))   # 8192: stuck at 512 if summed in bf16
                row("bf16 on CuPy", f"ones(64, 64): (a @ a)[0, 0] = {dot:g} (64), (2a).sum() = {total:g} (8192)",
                    dot == 64 and total == 8192)
            except Exception as err:  # noqa: BLE001 - any failure is the finding
                row("bf16 on CuPy", short_error(err), False)
        except Exception as err:  # noqa: BLE001
            row("cupy", f"{cupy.__version__}; no usable GPU: {short_error(err)}", "n/a" if args.cpu else "FAIL")
    except ImportError as err:
        row("cupy", f"not importable ({err})", "n/a" if args.cpu else "FAIL")
    from mpirt.comm.engines import nccl_available
    try:
        from cupy.cuda import nccl
        version = nccl.get_version() if nccl_available() else None
    except Exception:  # noqa: BLE001
        version = None
    row("nccl (cupy.cuda.nccl)", f"available, version {version}" if nccl_available() else "not available",
        nccl_available() or ("n/a" if args.cpu else "FAIL"))
    try:
        import torch
        cuda = torch.cuda.is_available()
        row("torch", f"{torch.__version__}; CUDA {torch.version.cuda}; "
                     f"{torch.cuda.get_device_name(0) if cuda else 'no GPU'}", cuda or ("n/a" if args.cpu else "FAIL"))
    except ImportError as err:
        row("torch", f"not importable ({err})", False)
    try:
        import mpi4py
        row("mpi4py", f"{mpi4py.__version__} ({Path(mpi4py.__file__).parent})")
    except ImportError as err:
        row("mpi4py", f"not importable ({err})", False)
    setup = (args.work / "mpi_setup.txt")
    how = setup.read_text().strip() if setup.exists() else "found as installed"
    loaded, detail = _mpi_probe()
    row("MPI library", f"{detail} ({how})" if loaded else f"none: {detail} ({how})", loaded)
    mpiexec = os.environ.get("MPIEXEC") or shutil.which("mpiexec")
    row("mpiexec", mpiexec or "none on PATH", bool(mpiexec))
    if loaded:
        from mpirt.comm.engines import cuda_aware_mpi
        row("CUDA-aware MPI", "yes (MPIX_Query_cuda_support)" if cuda_aware_mpi() else
            "no (host staging for MPI on device arrays)", "ok")
    smi = shutil.which("nvidia-smi")
    if smi:
        r = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        row("nvidia-smi", (r.stdout.strip() or r.stderr.strip())[:200], r.returncode == 0)
    else:
        row("nvidia-smi", "not on PATH", "n/a" if args.cpu else "FAIL")
    try:
        import pynvml  # noqa: F401
        row("nvidia-ml-py", "importable (NVML sampling)")
    except ImportError:
        row("nvidia-ml-py", "not importable: no NVML samples", "n/a" if args.cpu else "FAIL")
    save(args.work, "env", rows, data, t0)


# --- nvml ---------------------------------------------------------------------------------------------
def part_nvml(args) -> None:
    """Sample the GPU through :mod:`mpirt.monitor.gpu` every ``--interval`` s until ``WORK/nvml.stop``
    appears (or ``--max-seconds`` pass); write the samples with wall-clock times."""
    t0 = time.time()
    note = ""
    try:
        select(args.cpu)
        from mpirt.monitor import gpu as gpumon
        sampler, note = gpumon.start(args.interval)
    except Exception as err:  # noqa: BLE001 - the sampler must never fail the run
        sampler, note = None, f"NVML sampler not started: {short_error(err)}"
    offset = time.time() - time.perf_counter()
    samples = []
    stop = args.work / "nvml.stop"
    while not stop.exists() and time.time() - t0 < args.max_seconds:
        time.sleep(args.interval)
        if sampler is not None:
            samples += [(t + offset, s) for t, s in sampler.drain()]
            (args.work / "nvml.samples.json").write_text(json.dumps({"note": note, "samples": samples}))
    if sampler is not None:
        samples += [(t + offset, s) for t, s in sampler.drain()]
        sampler.close()
    save(args.work, "nvml", [], {"note": note, "interval": args.interval, "samples": samples}, t0)


def nvml_rows(samples: list, note: str, windows: dict) -> list:
    """Per part's timed window: mean utilisation, memory-bandwidth utilisation, power, SM clock and
    the most memory used."""
    from mpirt.monitor.gpu import mean
    if not samples:
        return [["nvml", "samples", f"none: {note}", "n/a"]]
    rows = [["nvml", "samples", f"{len(samples)} over the run ({note})", "ok"]]
    for part, (a, b) in windows.items():
        inside = [(t, s) for t, s in samples if a <= t <= b]
        if not inside:
            rows.append(["nvml", part, f"no sample in its {b - a:.1f} s window", "n/a"])
            continue
        m = mean(inside)
        rows.append(["nvml", part, f"util {m['gpu_util']:.0f}%, mem-bw {m['gpu_mem_bw_util']:.0f}%, "
                                   f"{m['gpu_power_w']:.0f} W, SM {m['gpu_sm_clock_mhz']:.0f} MHz, max used "
                                   f"{gib(max(s['gpu_mem_used_bytes'] for _, s in inside))} ({len(inside)} samples)", "ok"])
    return rows


# --- report -------------------------------------------------------------------------------------------
def read_status(work: Path) -> dict:
    """``part -> (state, rc, seconds, start, end)`` from the shell's ``status.tsv``."""
    out = {}
    path = work / "status.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            f = line.split("\t")
            if len(f) == 6:
                out[f[0]] = (f[1], int(f[2]), float(f[3]), float(f[4]), float(f[5]))
    return out


def log_tail(work: Path, part: str, n: int = 1) -> str:
    path = work / f"{part}.log"
    if not path.exists():
        return ""
    lines = [x.strip() for x in path.read_text(errors="replace").splitlines() if x.strip()]
    return " / ".join(lines[-n:])[:240]


def part_report(args) -> None:
    import common as BC

    work = args.work
    status = read_status(work)
    parts = {}
    for path in sorted(work.glob("*.json")):
        payload = json.loads(path.read_text())
        if isinstance(payload, dict) and payload.get("part") == path.stem:
            parts[path.stem] = payload
    order = [p for p in status] + [p for p in parts if p not in status and p != "nvml"]
    rows, windows = [], {}
    for part in order:
        if part in parts and part != "nvml":
            rows += parts[part]["rows"]
            timed = parts[part].get("window") or (parts[part]["t0"], parts[part]["t1"])
            windows[part] = tuple(timed)
        state = status.get(part, ("ok", 0, 0.0, 0.0, 0.0))
        if state[0] != "ok" or part not in parts:
            why = {"timeout": f"timed out after {state[2]:.0f} s", "skipped": "skipped: no time left"}.get(
                state[0], f"failed (exit {state[1]}) after {state[2]:.0f} s")
            tail = log_tail(work, part, 2)
            rows.append([section_of(part), f"{part}: part", why + (f": {tail}" if tail else ""), "FAIL"])
    rows += train_summary_rows(parts)
    nvml = parts.get("nvml", {}).get("data", {})
    if not nvml and (work / "nvml.samples.json").exists():
        nvml = json.loads((work / "nvml.samples.json").read_text())
    rows += nvml_rows([tuple(s) for s in nvml.get("samples", [])], nvml.get("note", "sampler did not report"), windows)
    for part, (state, rc, seconds, _, _) in status.items():
        rows.append(["parts", part, f"{state} in {seconds:.0f} s" + (f" (exit {rc})" if rc else ""), verdict(state == "ok")])
    present = {r[0] for r in rows}
    asked = {section_of(p) for p in status} | {"nvml", "parts"}
    rows += [[s, "(no rows)", "its part did not report" if s in asked else "not among GPU_CHECK_PARTS this time",
              "FAIL" if s in asked else "n/a"] for s in SECTIONS if s not in present]
    rows.sort(key=lambda r: SECTIONS.index(r[0]) if r[0] in SECTIONS else len(SECTIONS))

    env = parts.get("env", {}).get("data", {})
    load = BC.LoadMonitor()
    load.before, load.after = env.get("loadavg") or BC.loadavg(), BC.loadavg()
    load.wall_s = time.time() - min((p["t0"] for p in parts.values()), default=time.time())
    failed = [r for r in rows if r[3] == "FAIL"]
    notes = [
        "DRY RUN (--cpu): NumPy in place of CuPy, tiny shapes, PyTorch on the CPU: the figures mean nothing."
        if args.cpu else f"GPU: {env.get('cupy', '?')}",
        "Errors: ||x - ref|| / ||ref|| against NumPy float64 run from the same inputs rounded to the checked dtype "
        "(bf16 inputs' own rounding is not counted); NaN/inf never pass.",
        "MFU: mpirt.core.modeling.flops_per_token (6N + 12LCT) x tokens/s over the bf16 dense peak "
        f"({H200_BF16_PEAK / 1e12:.0f} TFLOP/s, H200 data sheet).",
        f"{len(failed)} row(s) FAIL" + (": " + "; ".join(f"{r[0]}/{r[1]}" for r in failed[:12]) if failed else "."),
    ]
    data = {"parts": parts, "status": {k: list(v) for k, v in status.items()}, "cpu_dry_run": args.cpu}
    BC.write_results(args.name, f"GPU check: mpirt on {'NumPy (dry run)' if args.cpu else 'CuPy'} against "
                     "NumPy float64 and PyTorch", ["section", "check", "result", "verdict"], rows, load, data,
                     notes, directory=args.out_dir)


def train_summary_rows(parts: dict) -> list:
    """mpirt over PyTorch in tokens/s per model, where both ran."""
    rows = []
    for model in ("350m", "1.3b"):
        m, t = parts.get(f"train-{model}-mpirt"), parts.get(f"train-{model}-torch")
        if m and t and m["data"].get("tokens_per_s") and t["data"].get("tokens_per_s"):
            r = m["data"]["tokens_per_s"] / t["data"]["tokens_per_s"]
            rows.append(["train", f"GPT-{model}: mpirt / torch", f"{r:.2f}x the tokens/s of PyTorch eager", "ok"])
    return rows


# --- main ---------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part")
    parser.add_argument("--work", type=Path, required=True, help="folder of the parts' JSON and logs")
    parser.add_argument("--cpu", action="store_true", help="dry run: NumPy for CuPy, tiny shapes, torch on CPU")
    parser.add_argument("--out-dir", type=Path, default=None, help="report: results folder (bench/results)")
    parser.add_argument("--name", default=None, help="report: results file name (gpu-<date>)")
    parser.add_argument("--interval", type=float, default=0.5, help="nvml: seconds between samples")
    parser.add_argument("--max-seconds", type=float, default=900.0, help="nvml: stop after this long at most")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.name = args.name or f"gpu-{'dryrun-' if args.cpu else ''}{time.strftime('%Y-%m-%d')}"
    ensure_models()
    import gpu_check_correct as correct
    import gpu_check_perf as perf
    parts = {"env": part_env, "nvml": part_nvml, "report": part_report, "ops": correct.part_ops,
             "optim": correct.part_optim, "gpt": correct.part_gpt, "matmul": perf.part_matmul,
             "allreduce": perf.part_allreduce, "allreduce-ranks": perf.part_allreduce_ranks, "profile": perf.part_profile,
             "attention": perf.part_attention,
             **{p: perf.part_train for p in TRAIN_PARTS}}
    if args.part not in parts:
        parser.error(f"unknown part {args.part!r}; expected one of {', '.join(parts)}")
    try:
        parts[args.part](args)
    except Exception:
        traceback.print_exc()
        sys.exit(1)


if __name__ == "__main__":
    main()

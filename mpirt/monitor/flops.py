"""Model FLOP utilisation (MFU) that can be trusted: the model's FLOPs, a peak that cannot be
beaten, and the GEMM floor.

**Model FLOPs** come from the model interface (:func:`mpirt.core.modeling.flops_per_token`): each
model type counts its own. GPT-2 and the Llama-style model use the PaLM / Megatron counting
``6 N + 12 L C T`` per token: ``6 N`` because every weight does one multiply-add (2 FLOPs)
forward and two backward (input and weight gradient), N counting the tied embedding once (the
head's GEMM) and leaving out position tables (lookups); ``12 L C T`` for the attention scores
``Q K^T`` and the weighted sum ``A V``, ``2 T C`` FLOPs each per token and layer forward, times 3
with the backward, over the full T x T square. Norms, activations, softmax and the loss are not
counted, nor recomputation (ZeRO-3 recomputes: its hardware FLOPs exceed the model FLOPs), so
MFU is the share of the peak spent on the model's own arithmetic.

**The peak** (:func:`resolve_peak`), in order: ``--peak-flops`` (per rank); on a GPU the
vendor's dense figure for the training dtype from :data:`GPU_PEAKS` (float32 GEMMs run on the
CUDA cores: CuPy does not turn on TF32; bf16 is listed for reference); on a CPU the FMA ceiling
(:func:`cpu_ceiling`): what the cores' FMA units do at most, measured once per machine by a C
loop (``kernels/fma_peak.c``, :func:`fma_rates`) on each core in the SIMD width cpuinfo names,
each rank counting its share of the node's physical cores; the same figure for every dtype
whose arithmetic runs in float32 (bfloat16, float16). Without a C compiler, the vendor-style
peak ``cores x FLOPs per cycle x clock`` (:func:`cpu_vendor_peak`) where cpufreq gives the
maximum clock, else :func:`gemm_rate` itself (:func:`remembered_gemm_rate`: the best rate seen
here; no ceiling, said so). A peak below the measured GEMM rate is replaced by that rate. The
source is reported with the figure (banner, summary); totals over ranks are labelled so.

**The GEMM floor**: the step's model FLOPs at the rate :func:`gemm_rate` measures for products
of the model's own layer shapes (rows = a micro-batch's tokens, widths ``n_embd`` and the MLP
width over tp), timed through :func:`mpirt.cpu.threads.matmul` as the layers run them. ``step time /
GEMM floor`` says how far a step is from what the BLAS library allows on these shapes.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import mpirt.core.backend as B
from mpirt.cpu.sysinfo import cache_dir, cpu_model, cpuinfo, processors, read_cache, update_cache

# Dense peak FLOP/s per GPU by dtype (vendor data sheets, SXM/OAM boards unless named); the
# first entry whose key is in the device name (lower case) wins, so specific names come first.
GPU_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("h100 pcie", {"bfloat16": 756e12, "float32": 51e12, "float64": 51e12}),
    ("h100", {"bfloat16": 989e12, "float32": 67e12, "float64": 67e12}),
    ("h200", {"bfloat16": 989e12, "float32": 67e12, "float64": 67e12}),
    ("gh200", {"bfloat16": 989e12, "float32": 67e12, "float64": 67e12}),
    ("b200", {"bfloat16": 2250e12, "float32": 80e12, "float64": 40e12}),
    ("a100", {"bfloat16": 312e12, "float32": 19.5e12, "float64": 19.5e12}),
    ("a800", {"bfloat16": 312e12, "float32": 19.5e12, "float64": 19.5e12}),
    ("l40s", {"bfloat16": 362e12, "float32": 91.6e12, "float64": 1.4e12}),
    ("a10", {"bfloat16": 125e12, "float32": 31.2e12, "float64": 0.98e12}),
    ("l4", {"bfloat16": 121e12, "float32": 30.3e12, "float64": 0.47e12}),
    ("v100", {"float16": 125e12, "float32": 15.7e12, "float64": 7.8e12}),
    ("rtx 4090", {"bfloat16": 165e12, "float32": 82.6e12, "float64": 1.3e12}),
    ("mi300x", {"bfloat16": 1307e12, "float32": 163e12, "float64": 163e12}),
    ("mi250x", {"bfloat16": 383e12, "float32": 95.7e12, "float64": 95.7e12}),
)


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s of one rank and where the figure comes from."""

    per_rank: float
    source: str     # "flag", "table", "fma", "vendor" or "calibrated"
    detail: str     # one line for the banner and the summary


def gpu_peak(device_name: str, dtype: str) -> float | None:
    """The :data:`GPU_PEAKS` figure for ``device_name`` and ``dtype``, or None when unknown."""
    name = device_name.lower()
    for key, peaks in GPU_PEAKS:
        if key in name:
            return peaks.get(dtype)
    return None


def cpu_flops_per_cycle(info: dict, dtype: str) -> int | None:
    """FLOPs per cycle of one core for ``dtype`` (float32/float64) from the x86 SIMD flags: two
    FMA units of the vector width (512 bits with AVX-512, except AMD Zen 4 and older, whose
    AVX-512 runs on 256-bit units; 256 with AVX2 + FMA), 2 FLOPs per lane. None without FMA or
    on other architectures (the caller then calibrates)."""
    flags = set(info.get("flags", "").split())
    if "fma" not in flags:
        return None
    bits = 256
    if "avx512f" in flags:
        zen4_or_older = info.get("vendor_id") == "AuthenticAMD" and int(info.get("cpu family", "0") or 0) < 26
        bits = 256 if zen4_or_older else 512
    lanes = bits // (64 if dtype == "float64" else 32)
    return 2 * 2 * lanes


def cpu_max_clock_hz() -> float | None:
    """The cores' maximum (boost) clock from cpufreq, or None where it is not exposed (VMs).
    /proc/cpuinfo's MHz and a model name's GHz are the current or base clock, which GEMMs beat
    under boost, so they never make a peak."""
    try:
        return int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) * 1e3
    except (OSError, ValueError):
        return None


def cpu_vendor_peak(cores: float, dtype: str) -> tuple[float | None, str]:
    """(``cores x FLOPs per cycle x maximum clock``, how it was read), or (None, why not)."""
    info = cpuinfo()
    per_cycle, clock = cpu_flops_per_cycle(info, dtype), cpu_max_clock_hz()
    if not per_cycle:
        return None, "no x86 FMA flags in /proc/cpuinfo"
    if not clock:
        return None, "no maximum clock readable (no cpufreq)"
    return cores * per_cycle * clock, (f"vendor-style: {cores:g} core(s) x {per_cycle} {dtype} FLOP/cycle x "
                                         f"{clock / 1e9:.2f} GHz ({info.get('model name', 'CPU')})")


def layer_products(n_embd: int, hidden: int, rows: int, dtype: str) -> list:
    """``(a, b)`` pairs shaped as a transformer layer's products on ``rows`` tokens: the MLP's
    up projection forward, its input gradient and its weight gradient (``hidden`` already divided
    by tp), on the active backend."""
    x = B.xp.ones((rows, n_embd), dtype=dtype)
    w = B.xp.ones((n_embd, hidden), dtype=dtype)
    g = B.xp.ones((rows, hidden), dtype=dtype)
    return [(x, w), (g, w.T), (x.T, g)]


GEMM_MEASURE_S = 0.3    # a rate's first measurement: the fastest of its rounds is the least disturbed by load
GEMM_CONFIRM_S = 0.05   # with a best rate recorded (remembered_gemm_rate), which bounds the result from below


def gemm_rate(products: list, seconds: float = GEMM_MEASURE_S) -> float:
    """FLOP/s of :func:`mpirt.cpu.threads.matmul` (the layers' path: mpirt's threads and GEMM
    library) on ``products``: the fastest of the rounds run in ``seconds``, the one least
    disturbed by other processes (a rate under load would make a peak that training beats)."""
    from mpirt.cpu import threads

    flops = sum(2.0 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in products)
    for a, b in products:  # warm-up: pool started, pages touched
        threads.matmul(a, b)
    best, start = math.inf, time.perf_counter()
    while best == math.inf or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        for a, b in products:
            threads.matmul(a, b)
        B.synchronize()
        best = min(best, time.perf_counter() - t0)
    return flops / best


def _gemm_rate_entry(products: list, ranks_on_node: int) -> tuple[Path, str]:
    """(the cache file, the key) of the best rate recorded for ``products`` with this machine's
    threads, ranks sharing the node and GEMM library."""
    from mpirt.cpu import blas, threads
    lib = blas.current().library
    text = json.dumps([cpu_model(), threads.num_threads(), ranks_on_node, lib.name, lib.version,
                       [(a.shape, b.shape, str(a.dtype)) for a, b in products]])
    return cache_dir() / "gemm_rate.json", hashlib.sha256(text.encode()).hexdigest()[:16]


def known_gemm_rate(products: list, ranks_on_node: int = 1) -> float:
    """The best rate recorded for ``products`` (:func:`remembered_gemm_rate`), 0.0 when none is."""
    path, key = _gemm_rate_entry(products, ranks_on_node)
    best = read_cache(path).get(key, 0.0)
    return float(best) if isinstance(best, (int, float)) else 0.0


def remembered_gemm_rate(products: list, measured: float, ranks_on_node: int = 1) -> float:
    """The higher of ``measured`` (:func:`gemm_rate`) and the best rate measured on this machine
    before for the same products, threads, ranks sharing the node and GEMM library
    (``$MPIRT_CACHE/gemm_rate.json``); a
    new best is recorded. A start under others' load measures a rate that later steps beat (an
    MFU above 100 %, a step "faster" than its GEMM floor); the best rate seen is the better
    bound. For the NumPy backend (a GPU's peak is its data sheet's)."""
    best = known_gemm_rate(products, ranks_on_node)
    if measured > best:
        update_cache(*_gemm_rate_entry(products, ranks_on_node), measured)
    return max(measured, best)


def simd_bytes(info: dict) -> int | None:
    """The widest SIMD registers ``/proc/cpuinfo`` names, in bytes: 64 with AVX-512, 32 with AVX,
    16 with SSE2 or ARM's ASIMD (NEON); None when it names none of them."""
    flags = set((info.get("flags") or info.get("Features", "")).split())
    for flag, width in (("avx512f", 64), ("avx", 32), ("sse2", 16), ("asimd", 16)):
        if flag in flags:
            return width
    return None


def physical_cores() -> dict[int, tuple]:
    """Each logical CPU's physical core, ``{cpu: (package, core)}`` from ``/proc/cpuinfo``
    (hyperthreads of one core share its FMA units, so a core counts once); a CPU whose core is
    not listed is a core of its own."""
    cores = {}
    for fields in processors():
        if "processor" in fields:
            cpu = int(fields["processor"])
            core = (fields.get("physical id"), fields.get("core id"))
            cores[cpu] = core if None not in core else ("cpu", cpu)
    return cores or {cpu: ("cpu", cpu) for cpu in range(os.cpu_count() or 1)}


def _fma_program() -> tuple[Path, str, int] | tuple[None, str, None]:
    """The FMA loop (``kernels/fma_peak.c``) built for this CPU's SIMD width in ``$MPIRT_CACHE``:
    (path, cache key, SIMD bytes), or (None, why not, None)."""
    from mpirt.cpu import kernels
    info = cpuinfo()
    cc, width = kernels.compiler(), simd_bytes(info)
    if cc is None:
        return None, "no C compiler for the FMA loop", None
    if width is None:
        return None, "no SIMD flags in /proc/cpuinfo", None
    source = Path(kernels.__file__).parent / "fma_peak.c"
    flags = ("-O2", "-march=native", "-ffp-contract=fast", f"-DVECTOR_BYTES={width}")
    key = hashlib.sha256(repr((source.read_bytes(), flags, os.path.realpath(cc), cpu_model(),
                               info.get("flags") or info.get("Features", ""))).encode()).hexdigest()[:16]
    target = cache_dir() / f"fma-peak-{key}"
    if not target.exists():
        try:
            kernels.compile_c(cc, flags, source, target)
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            return None, f"the FMA loop did not build: {err}", None
    return target, key, width


def _cached_rates(entry) -> dict[int, float]:
    """{cpu: FLOP/s} of a cache entry; what is not a CPU number and a positive rate is dropped
    (a damaged or hand-edited file: those CPUs are measured again)."""
    known = {}
    for cpu, rate in (entry.items() if isinstance(entry, dict) else ()):
        try:
            cpu, rate = int(cpu), float(rate)
        except (TypeError, ValueError):
            continue
        if rate > 0 and math.isfinite(rate):
            known[cpu] = rate
    return known


def fma_rates(cpus, bits: int) -> tuple[dict[int, float], str]:
    """({cpu: FLOP/s}, how) of the FMA loop on each of ``cpus``, one CPU at a time, in ``bits``-bit
    lanes (32: float32, 64: float64); ({}, why not) when it cannot run. Measured once per machine
    and kept in ``$MPIRT_CACHE/fma_peak.json`` (the best figure of each CPU: a loop timed in thread
    CPU time is not slowed by load, but a later measurement never lowers a ceiling). CPUs the loop
    may not run on take the best rate of the others."""
    program, key, width = _fma_program()
    if program is None:
        return {}, key
    path, entry = cache_dir() / "fma_peak.json", f"{key}/{bits}"
    known = _cached_rates(read_cache(path).get(entry))
    missing = [c for c in cpus if c not in known]
    if missing:
        try:
            out = subprocess.run([str(program), str(bits), *map(str, missing)], capture_output=True, text=True,
                                 timeout=10 + len(missing), check=True).stdout
        except (OSError, subprocess.SubprocessError) as err:
            return {}, f"the FMA loop did not run: {err}"
        for line in out.split("\n"):
            if line.strip():
                cpu, rate = line.split()
                known[int(cpu)] = max(known.get(int(cpu), 0.0), float(rate))
        update_cache(path, entry, {str(c): r for c, r in sorted(known.items())})
    if not known:
        return {}, "the FMA loop could run on none of the CPUs"
    best = max(known.values())
    return {c: known.get(c, best) for c in cpus}, f"{8 * width}-bit FMA loop"


def cpu_ceiling(comm, dtype: str, threads: int) -> tuple[float | None, str]:
    """(This rank's CPU peak, how it was found) from :func:`fma_rates`, or (None, why not).
    Collective over ``comm``: the ranks exchange their host and CPU affinity; the first rank of
    each host measures the cores its host's ranks may use, and each rank gets its share of every
    physical core it may use (1 / the ranks of the host that may use it), capped at ``threads``
    cores. bfloat16 and float16 compute in float32 on CPUs, so they have float32's peak."""
    bits = 64 if dtype == "float64" else 32
    places = comm.allgather_object((socket.gethostname(), sorted(os.sched_getaffinity(0))))
    host, mine = places[comm.rank]
    neighbours = [cpus for name, cpus in places if name == host]
    measurer = next(r for r, (name, _) in enumerate(places) if name == host)
    found = None
    if comm.rank == measurer:
        try:  # whatever fails here, the other ranks must still get an answer at the exchange below
            found = fma_rates(sorted({c for cpus in neighbours for c in cpus}), bits)
        except Exception as err:  # noqa: BLE001
            found = {}, f"the FMA loop failed: {type(err).__name__}: {err}"
    rates, how = comm.allgather_object(found)[measurer]
    if not rates:
        return None, how
    core_of = physical_cores()

    def core(cpu):
        return core_of.get(cpu, ("cpu", cpu))
    core_rate: dict[tuple, float] = {}
    for cpu in mine:  # a core runs at its best logical CPU's rate
        core_rate[core(cpu)] = max(core_rate.get(core(cpu), 0.0), rates[cpu])
    users = [{core(c) for c in cpus} for cpus in neighbours]
    share = {c: 1 / sum(c in used for used in users) for c in core_rate}
    cores = sum(share.values())
    peak = sum(share[core] * rate for core, rate in core_rate.items()) * min(1.0, threads / cores)
    used = min(cores, threads)
    return peak, (f"{how}: {used:g} core(s) x {peak / used / 1e9:.1f} GFLOP/s per core, "
                  f"{'float64' if bits == 64 else 'float32'} arithmetic ({cpu_model()})")


def resolve_peak(dtype: str, cores: float, measured_gemm: float, flag: float = 0.0,
                 ceiling: tuple[float | None, str] | None = None) -> Peak:
    """This rank's peak (see the module docstring); ``cores``: the cores its GEMM threads can use
    (fewer than the threads when ranks oversubscribe a node); ``measured_gemm``: :func:`gemm_rate`;
    ``ceiling``: :func:`cpu_ceiling`'s answer on a CPU."""
    if flag > 0:
        return Peak(flag, "flag", f"--peak-flops {flag:.3g} FLOP/s per rank")
    info = B.device_info()
    if info is not None:
        peak = gpu_peak(info["name"], dtype)
        if peak:
            return Peak(peak, "table", f"{info['name']} {dtype} dense peak {peak / 1e12:g} TFLOP/s (data sheet)")
        return Peak(measured_gemm, "calibrated", f"{info['name']} not in the peak table: measured GEMM rate "
                                                 f"{measured_gemm / 1e12:.2f} TFLOP/s (pass --peak-flops)")
    fma, fma_how = ceiling or (None, "not measured")
    if fma is not None and fma >= measured_gemm:
        return Peak(fma, "fma", fma_how)
    vendor, how = cpu_vendor_peak(cores, dtype)
    if vendor is not None and vendor >= measured_gemm:
        return Peak(vendor, "vendor", how)
    why = ("the GEMMs outran the FMA loop" if fma is not None
           else "the vendor-style peak is below the measured GEMM rate" if vendor else f"{fma_how}; {how}")
    return Peak(measured_gemm, "calibrated", f"measured GEMM rate of the training's threads and GEMM path ({why})")

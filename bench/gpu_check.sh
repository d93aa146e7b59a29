#!/usr/bin/env bash
# bench/gpu_check.sh: mpirt on one lent H200 in one call of a few minutes, installing nothing from the
# network (that machine reaches no registry). Each part runs bench/gpu_check.py in its own process
# under its own timeout; a part that fails, crashes or times out is recorded and the next one runs.
#
#   env        CuPy version and GPU, bf16 on CuPy, NCCL, torch, mpi4py and whether an MPI library
#              loads, mpiexec, CUDA-aware MPI, nvidia-smi, nvidia-ml-py
#   ops        every op in mpirt.core.ops.__all__ forward and backward on CuPy float64/float32/bfloat16
#              against NumPy float64 (+ finite differences on the GPU in float64)
#   optim      AdamW (float64/32, bf16 and fp16 with float32 masters) and the global norm vs float64
#   gpt        a full GPT step (forward, backward, clip, AdamW) on CuPy vs NumPy float64
#   matmul     bf16 and fp16 8192^3 and 8192x2048x8192 products: mpirt vs torch.matmul, TFLOP/s
#   attention  the CUDA flash attention (mpirt/gpu/cuda_kernels.cu) forward + backward at the
#              training shapes and at odd lengths, against torch's scaled_dot_product_attention and
#              mpirt's float32 xp form: errors, then times
#   allreduce  mpirt.comm at 1 rank through each engine (nccl, staged, cuda-aware if the MPI has
#              it), and 2 ranks on the one GPU under mpiexec, host-staged
#   train-350m-{mpirt,torch}, train-1.3b-{mpirt,torch}
#              bf16 GPT training (GPT-2 medium 355M; 24 x 2048 = 1.3B), 8 x 1024 tokens a step,
#              tokens/s and MFU against the 989 TFLOP/s bf16 dense peak, beside a PyTorch eager GPT
#              of the same shape (autocast bf16, F.scaled_dot_product_attention, fused AdamW)
#   profile    where the 1.3B mpirt step's time goes: each Function's passes, AdamW, the clip and
#              the GEMM calls, each between two drained queues
#   nvml       mpirt.monitor.gpu samples the GPU all along (background); the report gives its means
#              over each part's timed window
# The table goes to bench/results/gpu-<date>.md (+ .json); with $OUT set (the device tool), the
# table, the JSON, every part's log and the CuPy kernel cache are copied to $OUT.
#
# The lent machine (see /work/.library/device/KINDS.md, nvidia-h200): python3 is the image's
# Python 3.12 with CuPy 14 for CUDA 13 (bfloat16 through ml_dtypes), PyTorch, nvidia-nccl-cu13,
# nvidia-ml-py and mpi4py, but no MPI library is listed: mpi4py then cannot load. The MPICH wheel
# travels as a file in gpu_carry/ (ignored by git) and is installed offline into /tmp here. Before
# the call, in the repository root on the machine with the registry:
#
#   mkdir -p gpu_carry && python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 -d gpu_carry mpich==5.0.2
#   # optional: a CuPy kernel cache a previous call returned saves its compile time:
#   # cp <files_at>/cupy-cache.tar.gz gpu_carry/
#
# (13 MB; `pip install --no-index --find-links gpu_carry mpich` is the same install.) mpirt itself
# needs no install there: bench/gpu_check.py imports it from the tree and maps models/ to
# mpirt.models as pip's package-dir would.
#
# The call (one device run; ~1.5 min machine start + at most GPU_CHECK_LIMIT = 390 s + transfers,
# under 9 minutes of the 15-minute lease, leaving a rerun of some parts):
#
#   run(command="PYTHONUNBUFFERED=1 bash bench/gpu_check.sh", timeout_s=450, carry=["gpu_carry"])
#
# Then copy <files_at>/gpu-<date>.md (and .json) to bench/results/ and commit the .md. To rerun
# only some parts, at once while the machine is warm (30 s) or on a fresh one (>= 4 min left):
#
#   run(command="GPU_CHECK_PARTS='train-1.3b-mpirt train-1.3b-torch' GPU_CHECK_LIMIT=200 bash bench/gpu_check.sh",
#       timeout_s=240, carry=["gpu_carry"])
#
# A rerun's table holds only its parts, under the same name: add GPU_CHECK_NAME=gpu-<date>-rerun to
# keep the two apart. timeout_s stays above GPU_CHECK_LIMIT + 30 (the script's own hard limit).
#
# Here, without a GPU (the dry run: NumPy for CuPy, tiny shapes, torch on the CPU; tests/test_gpu_check.py):
#
#   bash bench/gpu_check.sh --cpu          # writes to a temporary folder unless GPU_CHECK_OUT_DIR
#
# Settings (environment): GPU_CHECK_PARTS (space-separated, default all, in the order above),
# GPU_CHECK_LIMIT (overall seconds, hard: the whole script is killed 30 s after it),
# GPU_CHECK_OUT_DIR (default bench/results; the work folder in --cpu), GPU_CHECK_NAME (default
# gpu-<date>, gpu-dryrun-<date> in --cpu), GPU_CHECK_WORK (the parts' JSON and logs), PYTHON
# (default python3). Exit code: 0 when every part ran and every row passed, 1 when a part or row
# failed, 2 when no table was written.
set -uo pipefail
SCRIPT="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SCRIPT")/.."

CPU=""
case "${1:-}" in
    --cpu|--dry-run) CPU="--cpu" ;;
    "") ;;
    *) echo "usage: bash bench/gpu_check.sh [--cpu|--dry-run]" >&2; exit 2 ;;
esac
LIMIT=${GPU_CHECK_LIMIT:-390}
if [ -z "${GPU_CHECK_INNER:-}" ]; then   # the hard overall limit, whatever hangs inside
    GPU_CHECK_INNER=1 exec timeout -k 10 $((LIMIT + 30)) bash "$SCRIPT" "$@"
fi

PY=${PYTHON:-python3}
ALL="env ops optim gpt matmul attention allreduce train-350m-mpirt train-350m-torch train-1.3b-mpirt train-1.3b-torch profile"
PARTS=${GPU_CHECK_PARTS:-$ALL}
WORK=${GPU_CHECK_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
mkdir -p "$WORK"
if [ -n "$CPU" ]; then
    OUTDIR=${GPU_CHECK_OUT_DIR:-$WORK}
    NAME=${GPU_CHECK_NAME:-gpu-dryrun-$(date +%F)}
    export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
else
    OUTDIR=${GPU_CHECK_OUT_DIR:-bench/results}
    NAME=${GPU_CHECK_NAME:-gpu-$(date +%F)}
fi
export PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$WORK/cupy-cache}
REPORT_RESERVE=25
declare -A BUDGET=([env]=40 [ops]=90 [optim]=30 [gpt]=45 [matmul]=45 [attention]=60 [allreduce]=75
                   [train-350m-mpirt]=75 [train-350m-torch]=45 [train-1.3b-mpirt]=120 [train-1.3b-torch]=60 [profile]=90)
echo "gpu_check: parts [$PARTS], limit ${LIMIT}s, work $WORK, table $OUTDIR/$NAME.md${CPU:+ (dry run)}"

# --- MPI: use the machine's if mpi4py loads one, else the carried MPICH wheel, installed offline ---
: >"$WORK/mpi_setup.txt"
if ! timeout 60 "$PY" -c "from mpi4py import MPI" >/dev/null 2>&1; then
    whl=$(ls gpu_carry/mpich-*.whl 2>/dev/null | head -n 1)
    if [ -n "$whl" ] && timeout 120 "$PY" -m pip install -q --no-index --no-deps --ignore-installed --no-compile \
            --prefix /tmp/mpirt-mpich "$whl" >"$WORK/mpich-install.log" 2>&1; then
        export MPI4PY_LIBMPI=/tmp/mpirt-mpich/lib/libmpi.so.12
        export LD_LIBRARY_PATH=/tmp/mpirt-mpich/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        export PATH=/tmp/mpirt-mpich/bin:$PATH
        echo "carried wheel $(basename "$whl") installed offline in /tmp/mpirt-mpich" >"$WORK/mpi_setup.txt"
    else
        echo "mpi4py loads no MPI library and no usable gpu_carry/mpich-*.whl (see the header)" >"$WORK/mpi_setup.txt"
    fi
fi
MPIEXEC=$(command -v mpiexec || true)
export MPIEXEC
echo "gpu_check: MPI: $(cat "$WORK/mpi_setup.txt")${MPIEXEC:+ mpiexec $MPIEXEC}"

# --- a CuPy kernel cache returned by an earlier call (optional) ---
if [ -z "$CPU" ] && [ -f gpu_carry/cupy-cache.tar.gz ]; then
    mkdir -p "$CUPY_CACHE_DIR" && tar -xzf gpu_carry/cupy-cache.tar.gz -C "$CUPY_CACHE_DIR" 2>/dev/null
fi

# --- NVML sampler in the background for the whole run ---
rm -f "$WORK/nvml.stop"
"$PY" bench/gpu_check.py nvml --work "$WORK" --max-seconds "$LIMIT" $CPU >"$WORK/nvml.log" 2>&1 &
NVML_PID=$!

start=$SECONDS
deadline=$((start + LIMIT - REPORT_RESERVE))
: >"$WORK/status.tsv"
for part in $PARTS; do
    budget=${BUDGET[$part]:-60}
    left=$((deadline - SECONDS))
    now=$(date +%s.%N)
    if [ "$left" -lt 10 ]; then
        printf '%s\tskipped\t0\t0\t%s\t%s\n' "$part" "$now" "$now" >>"$WORK/status.tsv"
        echo "gpu_check: $part skipped (no time left)"
        continue
    fi
    [ "$budget" -gt "$left" ] && budget=$left
    t0=$SECONDS
    timeout -k 5 "$budget" "$PY" bench/gpu_check.py "$part" --work "$WORK" $CPU >"$WORK/$part.log" 2>&1
    rc=$?
    state=ok
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && state=timeout
    [ "$state" = ok ] && [ "$rc" != 0 ] && state=failed
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$part" "$state" "$rc" "$((SECONDS - t0))" "$now" "$(date +%s.%N)" >>"$WORK/status.tsv"
    echo "gpu_check: $part $state in $((SECONDS - t0))s (limit ${budget}s)"
    [ "$state" = ok ] || tail -n 4 "$WORK/$part.log" | sed 's/^/    /'
done

touch "$WORK/nvml.stop"
for _ in 1 2 3 4 5 6; do kill -0 "$NVML_PID" 2>/dev/null || break; sleep 1; done
kill "$NVML_PID" 2>/dev/null
wait "$NVML_PID" 2>/dev/null

timeout -k 5 "$REPORT_RESERVE" "$PY" bench/gpu_check.py report --work "$WORK" --out-dir "$OUTDIR" --name "$NAME" $CPU \
    >"$WORK/report.log" 2>&1
report_rc=$?
# the end of the output is what the device tool's reply shows: the key rows, the failures, the verdict
if [ -f "$OUTDIR/$NAME.md" ]; then
    grep -E '^\| (matmul|attention|train|allreduce|profile) \||\| FAIL \|$' "$OUTDIR/$NAME.md" | grep -v '^| parts |' | head -n 70
    tail -n 9 "$WORK/report.log"
else
    cat "$WORK/report.log"
fi

if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then   # the device tool brings back what is under $OUT
    cp "$OUTDIR/$NAME.md" "$OUTDIR/$NAME.json" "$OUT/" 2>/dev/null
    tar -czf "$OUT/gpu_check-logs.tar.gz" -C "$WORK" --exclude=cupy-cache . 2>/dev/null
    if [ -d "$CUPY_CACHE_DIR" ]; then
        tar -czf "$OUT/cupy-cache.tar.gz" -C "$CUPY_CACHE_DIR" . 2>/dev/null
        [ "$(stat -c %s "$OUT/cupy-cache.tar.gz" 2>/dev/null || echo 0)" -gt 15000000 ] && rm -f "$OUT/cupy-cache.tar.gz"
    fi
fi

if [ "$report_rc" != 0 ] || [ ! -f "$OUTDIR/$NAME.md" ]; then
    echo "gpu_check: no table written (report exit $report_rc)"
    exit 2
fi
if cut -f2 "$WORK/status.tsv" | grep -qv '^ok$' || grep -q '| FAIL |' "$OUTDIR/$NAME.md"; then
    echo "gpu_check: some parts or rows failed: $OUTDIR/$NAME.md"
    exit 1
fi
echo "gpu_check: all parts ok: $OUTDIR/$NAME.md"

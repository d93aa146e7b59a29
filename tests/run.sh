#!/usr/bin/env bash
# The whole test suite: the single-process tier, then the multi-rank tier under mpiexec at 2, 4 and
# 8 ranks. `python -m mpi4py` aborts every rank when one fails, and `timeout` bounds a hang.
set -euo pipefail
cd "$(dirname "$0")/.."
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
python -m pytest -q -p no:cacheprovider tests "$@"
for n in 2 4 8; do
    echo "=== multi-rank tier: $n ranks ==="
    timeout 1200 mpiexec -n "$n" python -m mpi4py -m pytest -q -p no:cacheprovider --with-mpi -m mpi \
        tests "$@"
done

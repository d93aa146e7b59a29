#!/usr/bin/env bash
# The whole test suite, tier by tier: the single-process tier; the multi-rank tier under mpiexec at
# 2, 4 and 8 ranks (`python -m mpi4py` aborts every rank when one fails, `timeout` bounds a hang);
# then the real-SLURM tier (tests/slurm/run.sh: it needs root, and apt-get unless SLURM is installed;
# without them it is skipped with a line saying so, except under CI=true where it must run). Each
# tier prints one rank's pytest output; the
# other ranks' go to files, shown only when the tier fails. A table of every tier ends the run,
# and the exit code is non-zero when any tier failed. Extra arguments go to the pytest calls of the
# single-process and multi-rank tiers.
set -uo pipefail
cd "$(dirname "$0")/.."
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
results=$(mktemp -d "${TMPDIR:-/tmp}/mpirt-tests.XXXXXX")
failed=0

tier() {  # tier NAME COMMAND...: run one tier, record its exit code and seconds
    local name=$1 start=$SECONDS rc
    shift
    echo "=== tier $name ==="
    "$@"
    rc=$?
    echo "$name $rc $((SECONDS - start))" >>"$results/tiers"
    [ "$rc" = 0 ] || failed=1
}

tier single python -m pytest -q -p no:cacheprovider --junitxml="$results/single/rank0.xml" tests "$@"
for n in 2 4 8; do
    tier "mpi-$n" timeout 1200 mpiexec -n "$n" bash tests/rank_output.sh "$results/mpi-$n" \
        python -m mpi4py -m pytest -q -p no:cacheprovider --with-mpi -m mpi tests "$@"
done
why=$(bash tests/slurm/run.sh --why-not)
if [ -n "$why" ] && [ "${CI:-}" != true ]; then
    echo "=== tier slurm: SKIPPED: $why; run it as root with: sudo bash tests/slurm/run.sh ==="
    echo "slurm skipped 0" >>"$results/tiers"
else
    tier slurm bash tests/slurm/run.sh  # all of it: a -k filter would leave this tier nothing to run
fi

python tests/tier_report.py "$results"
exit "$failed"

#!/bin/bash
# SLURM Epilog (runs as root on each node after a job): remove the job owner's MPICH
# shared-memory files in /dev/shm that no process uses. A killed MPICH job leaves them, and a
# requeued job (same job id) can then fail in MPI_Init. Install on every compute node and set
#   Epilog=/etc/slurm/epilog.d/mpirt-mpich-shm.sh   in slurm.conf (or call it from your Epilog).
# Written by `python -m mpirt.slurm --epilog`. Always exits 0: a failing Epilog drains the node.
mpirt_clean_shm() {
    local uid=$1 dir=${2:-/dev/shm} before=${3:-} busy f
    local files=("$dir"/mpich_*)
    busy=$( { cat /proc/[0-9]*/maps; ls -l /proc/[0-9]*/fd; } 2>/dev/null \
        | grep -o "$dir/mpich_[^ ]*" | sort -u) || true
    for f in "${files[@]}"; do
        [ -f "$f" ] && [ "$(stat -c %u "$f" 2>/dev/null)" = "$uid" ] || continue
        [ -z "$before" ] || [ "$(stat -c %Y "$f" 2>/dev/null || echo "$before")" -lt "$before" ] || continue
        grep -qxF -- "$f" <<<"$busy" && continue
        rm -f -- "$f" && echo "mpirt: removed stale MPICH shared memory $f"
    done
    return 0
}
[ -n "${SLURM_JOB_UID:-}" ] && mpirt_clean_shm "$SLURM_JOB_UID" "${MPIRT_SHM_DIR:-/dev/shm}"
exit 0

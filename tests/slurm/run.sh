#!/usr/bin/env bash
# The real-SLURM tier: install SLURM from Debian's packages (unless installed), start a one-node
# cluster on localhost (munged, slurmctld, slurmd), submit mpirt's job templates as a non-root
# user through tests/slurm/test_slurm_jobs.py, stop the daemons it started and check that the
# jobs left nothing in /dev/shm. Needs root and apt; without them it fails, it never skips.
#
#   bash tests/slurm/run.sh [PYTEST ARGS]   the whole tier
#   bash tests/slurm/run.sh --up            start the cluster and leave it running (prints how to
#                                           use and stop it), for working on the templates
#   bash tests/slurm/run.sh --down DIR      stop a cluster started with --up
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
USER_NAME=${MPIRT_SLURM_USER:-mpirtci}       # the non-root user that submits the jobs
SECONDS=0

die() { echo "slurm tier: FAILED: $*" >&2; exit 1; }
running() {  # the PIDs of processes named $1 (procps may be missing on a minimal image)
    local comm
    for comm in /proc/[0-9]*/comm; do
        [ "$(cat "$comm" 2>/dev/null)" = "$1" ] && basename "$(dirname "$comm")"
    done
    return 0
}
say() { echo "slurm tier: $*"; }

stop_daemons() {  # stop what this tier started, by the PIDs in their pid files (newest first)
    local dir=$1 pidfile pid
    for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munged.pid"; do
        [ -s "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        kill -TERM "$pid" 2>/dev/null || continue
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -0 "$pid" 2>/dev/null && { say "pid $pid ignored TERM, killing it"; kill -KILL "$pid" || true; }
        rm -f "$pidfile"
    done
    if [ -f "$dir/opened-dirs" ]; then
        while read -r mode path; do chmod "$mode" "$path"; done <"$dir/opened-dirs"
        rm -f "$dir/opened-dirs"
    fi
}

if [ "${1:-}" = "--down" ]; then
    [ -d "${2:-}" ] || die "--down needs the directory that --up printed"
    stop_daemons "$2"
    rm -rf "$2"
    exit 0
fi

[ "$(id -u)" = 0 ] || die "run as root: the tier installs packages, starts daemons and adds a user"
exec 9>/tmp/mpirt-slurm-tier.lock
flock -n 9 || die "another run of this tier is in progress (/tmp/mpirt-slurm-tier.lock)"
for daemon in slurmctld slurmd; do
    pid=$(running "$daemon")
    if [ -n "$pid" ]; then
        die "a $daemon is already running (pid $pid): this tier starts its own cluster; stop that one first"
    fi
done

# --- install -------------------------------------------------------------------------------------
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null; then
    say "SLURM already installed: $(dpkg-query -W -f '${Version}' slurmctld 2>/dev/null)"
else
    say "installing slurmctld slurmd slurm-client munge with apt-get"
    command -v apt-get >/dev/null || die "apt-get not found: this tier installs SLURM from Debian's packages"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q </dev/null || die "apt-get update failed (no network or no apt mirror?): cannot install SLURM"
    apt-get install -y -q slurmctld slurmd slurm-client munge </dev/null \
        || die "apt-get install slurmctld slurmd slurm-client munge failed"
    say "installed SLURM $(dpkg-query -W -f '${Version}' slurmctld) in ${SECONDS}s"
fi

# --- the user that submits jobs, the tier's directory, and what the user must be able to read ------
id "$USER_NAME" >/dev/null 2>&1 || useradd -m -s /bin/bash "$USER_NAME" || die "useradd $USER_NAME failed"
as_user() { runuser -u "$USER_NAME" -- "$@"; }
D=$(mktemp -d /tmp/mpirt-slurm.XXXXXX)
chmod 755 "$D"
mkdir -p "$D/state" "$D/spool" "$D/log" "$D/work"
chown slurm:slurm "$D/state" "$D/log" "$D"
chown "$USER_NAME" "$D/work"
cleanup() {
    local rc=$?
    if [ "${KEEP_UP:-0}" = 1 ] && [ "$rc" = 0 ]; then return; fi
    stop_daemons "$D"
    [ "$rc" = 0 ] || { say "logs of the failed run:"; tail -n 30 "$D"/log/*.log >&2 || true; }
    rm -rf "$D"
}
trap cleanup EXIT

# CI clones anywhere (e.g. under /root, mode 700), and the venv's interpreter may live there too:
# let the user traverse the ancestors (stop_daemons restores their modes) and read the tree.
reach() {
    local dir
    dir=$(dirname "$(readlink -f "$1")")
    while [ "$dir" != / ]; do
        if ! as_user test -x "$dir"; then
            echo "$(stat -c %a "$dir") $dir" >>"$D/opened-dirs"
            chmod o+x "$dir"
        fi
        dir=$(dirname "$dir")
    done
}
reach "$ROOT/tests"
reach "$ROOT/.venv/bin/python"
as_user test -r "$ROOT/.venv/bin/activate" && as_user test -r "$ROOT/mpirt/train.py" \
    || chmod -R o+rX "$ROOT"
as_user "$ROOT/.venv/bin/python" -c "import mpirt, mpi4py, pytest" \
    || die "user $USER_NAME cannot import mpirt from $ROOT/.venv (install it with pip install -e .[dev])"

# --- configuration ---------------------------------------------------------------------------------
node=$(slurmd -C | head -1) || die "slurmd -C failed"
memory=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node")
node=$(sed -e 's/NodeName=[^ ]*/NodeName=localhost/' \
    -e "s/RealMemory=[0-9]*/RealMemory=$((memory * 85 / 100))/" <<<"$node")
cat >"$D/slurm.conf" <<EOF
# One node on localhost, written by tests/slurm/run.sh. MpiDefault=none as in SLURM's own default:
# the job templates must choose the PMI themselves.
ClusterName=mpirtci
SlurmctldHost=localhost
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits cred_expire seconds (default 120) before it may start again
AuthInfo=cred_expire=5
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.log
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=600
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
$node
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$D/slurm.conf

# --- daemons ---------------------------------------------------------------------------------------
if [ -n "$(running munged)" ]; then
    say "using the munged that is already running"
else
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    [ -s /etc/munge/munge.key ] || mungekey --create --keyfile /etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid || die "munged did not start"
    cp /run/munge/munged.pid "$D/munged.pid"
fi
/usr/sbin/slurmctld || die "slurmctld did not start (see $D/log/slurmctld.log)"
/usr/sbin/slurmd -N localhost || die "slurmd did not start (see $D/log/slurmd.log)"
for _ in $(seq 60); do
    [ "$(sinfo -h -o %T 2>/dev/null)" = idle ] && break
    sleep 0.5
done
[ "$(sinfo -h -o %T 2>/dev/null)" = idle ] || die "the node did not become idle: $(sinfo -h -o '%T %E' 2>&1)"
say "cluster up after ${SECONDS}s: $(sinfo -h -o '%N %T %c CPUs %m MB')"

if [ "${1:-}" = "--up" ]; then
    KEEP_UP=1
    say "left running. Submit as $USER_NAME with SLURM_CONF=$SLURM_CONF; stop with: bash $0 --down $D"
    exit 0
fi

# --- the jobs --------------------------------------------------------------------------------------
rc=0
cd "$D/work"
as_user env -i PATH="$ROOT/.venv/bin:/usr/bin:/bin" HOME="$(getent passwd "$USER_NAME" | cut -d: -f6)" \
    SLURM_CONF="$SLURM_CONF" MPIRT_SLURM_TIER=1 MPIRT_SLURM_WORK="$D/work" MPIRT_ROOT="$ROOT" \
    PYTHONDONTWRITEBYTECODE=1 OPENBLAS_NUM_THREADS=1 \
    timeout 600 "$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider \
    -s --basetemp="$D/work/pytest" "$ROOT/tests/slurm" "$@" || rc=$?

# the user's jobs are over; whatever MPICH left in /dev/shm now was left by them
stale=$(find /dev/shm -maxdepth 1 -user "$USER_NAME" 2>/dev/null)
stop_daemons "$D"
[ -z "$stale" ] || { rc=1; say "FAILED: the jobs left files in /dev/shm:"; echo "$stale"; }
[ "$rc" = 0 ] && say "passed in ${SECONDS}s" || say "FAILED (rc $rc) after ${SECONDS}s"
exit "$rc"

#!/usr/bin/env bash
# The real-SLURM tier: install SLURM from Debian's packages (unless installed), start a one-node
# cluster on localhost (munged, slurmctld, slurmd), submit mpirt's job templates as a non-root
# user through tests/slurm/test_slurm_jobs.py, stop the daemons it started and check that the
# jobs left nothing in /dev/shm. Needs root and apt; without them it fails, it never skips.
# It runs beside any other SLURM cluster on the machine (its own ports, paths and ClusterName),
# and tests that on every run: a minimal neighbour cluster on SLURM's default ports 6817/6818
# (unless a real one holds them) runs during the tests and must still answer at the end.
#
#   bash tests/slurm/run.sh [PYTEST ARGS]   the whole tier
#   bash tests/slurm/run.sh --up            start the cluster and leave it running (prints how to
#                                           use and stop it), for working on the templates
#   bash tests/slurm/run.sh --down DIR      stop a cluster started with --up
#   bash tests/slurm/run.sh --why-not       print why this user cannot run the tier here (nothing
#                                           when it can); tests/run.sh skips it on that line
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
        # a daemon that died left its PID free for reuse: kill only the daemon the file names
        if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" != "$(basename "$pidfile" .pid)" ]; then
            rm -f "$pidfile"
            continue
        fi
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

why_not() {
    if [ "$(id -u)" != 0 ]; then
        echo "it needs root (it installs SLURM, starts its daemons and adds a user)"
    elif ! command -v slurmctld >/dev/null && ! command -v apt-get >/dev/null; then
        echo "SLURM is not installed and there is no apt-get to install it"
    fi
}
if [ "${1:-}" = "--why-not" ]; then
    why_not
    exit 0
fi
if [ "${1:-}" = "--down" ]; then
    [ -d "${2:-}" ] || die "--down needs the directory that --up printed"
    stop_daemons "$2"
    rm -rf "$2"
    exit 0
fi

reason=$(why_not)
[ -z "$reason" ] || die "$reason"
exec 9>/tmp/mpirt-slurm-tier.lock
flock -n 9 || die "another run of this tier is in progress (/tmp/mpirt-slurm-tier.lock)"
# another cluster's daemons (a site's, or one left up with --up) may run here: noted, left alone
foreign=""
for daemon in slurmctld slurmd; do
    pids=$(running "$daemon" | tr '\n' ' ')
    [ -z "$pids" ] || foreign="${foreign:+$foreign, }$daemon (pid ${pids% })"
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
NB=""                                        # the neighbour cluster's directory, once started
cleanup() {
    local rc=$?
    if [ -n "$NB" ]; then
        [ "$rc" = 0 ] || { say "logs of the neighbour cluster:"; tail -n 10 "$NB"/log/*.log >&2 || true; }
        stop_daemons "$NB"
        rm -rf "$NB"
    fi
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
bindable() {  # the first $1 of the TCP ports $2... that a daemon could listen on now, on one line
    "$ROOT/.venv/bin/python" - "$@" <<'PYTHON'
import socket, sys
want, found = int(sys.argv[1]), []
for port in map(int, sys.argv[2:]):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as slurmctld and slurmd bind
        try:
            s.bind(("", port))
        except OSError:
            continue
    found.append(port)
    if len(found) == want:
        break
print(*found)
PYTHON
}
# This cluster's own ports, from 16817 up: below the kernel's ephemeral range (32768-60999 by
# default), so no outgoing connection takes one before the daemons bind it. srun listens on ports
# the kernel picks (no SrunPortRange), which cannot collide with another cluster's.
read -r CTLD_PORT SLURMD_PORT <<<"$(bindable 2 $(seq 16817 17816))"
[ -n "${SLURMD_PORT:-}" ] || die "no two free TCP ports in 16817-17816 for slurmctld and slurmd"
[ -z "$foreign" ] \
    || say "another cluster runs here: $foreign; this tier uses its own ports $CTLD_PORT/$SLURMD_PORT"
suffix=${D##*.}
cluster=mpirtci${suffix,,}                  # SLURM wants cluster names in lower case
node=$(slurmd -C | head -1) || die "slurmd -C failed"
memory=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node")
node=$(sed -e 's/NodeName=[^ ]*/NodeName=localhost/' \
    -e "s/RealMemory=[0-9]*/RealMemory=$((memory * 85 / 100))/" <<<"$node")
cluster_paths() {  # the slurm.conf lines that put a cluster's state, spool, pids and logs under $1
    printf '%s\n' "StateSaveLocation=$1/state" "SlurmdSpoolDir=$1/spool" "SlurmctldPidFile=$1/slurmctld.pid" \
        "SlurmdPidFile=$1/slurmd.pid" "SlurmctldLogFile=$1/log/slurmctld.log" "SlurmdLogFile=$1/log/slurmd.log"
}
cat >"$D/slurm.conf" <<EOF
# One node on localhost, written by tests/slurm/run.sh. MpiDefault=none as in SLURM's own default:
# the job templates must choose the PMI themselves. Ports, paths and ClusterName are this run's
# own, so that it runs beside another cluster; so are the job IDs (the tests find a job's ranks
# by SLURM_JOB_ID, which another cluster's job of the same user may share).
ClusterName=$cluster
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
FirstJobId=$((CTLD_PORT * 1000))
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits cred_expire seconds (default 120) before it may start again
AuthInfo=cred_expire=5
$(cluster_paths "$D")
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
    # 9>&- here and below: a daemon must not inherit the tier's lock (one left up would hold it)
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid 9>&- || die "munged did not start"
    cp /run/munge/munged.pid "$D/munged.pid"
fi
idle() {  # whether the cluster of slurm.conf $1 answers that its partition $2 is idle
    [ "$(SLURM_CONF=$1 sinfo -h -o '%R %T' 2>/dev/null)" = "$2 idle" ]
}

# The neighbour: what a site's cluster on this machine would be, on SLURM's default ports. Only
# sinfo talks to it; it must still answer after the tests.
if [ "${1:-}" = "--up" ]; then
    :  # a cluster left up needs no neighbour, and nothing would stop it
elif [ "$(bindable 2 6817 6818)" != "6817 6818" ]; then
    say "ports 6817/6818 are taken (another cluster?): it is this run's neighbour, none started"
else
    NB=$(mktemp -d /tmp/mpirt-slurm-neighbour.XXXXXX)
    mkdir -p "$NB/state" "$NB/spool" "$NB/log"
    chown slurm:slurm "$NB" "$NB/state" "$NB/log"
    cat >"$NB/slurm.conf" <<EOF
# The neighbour cluster of tests/slurm/run.sh: SLURM's default ports, no jobs.
ClusterName=mpirtneighbour
SlurmctldHost=localhost
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=slurm
AuthType=auth/munge
$(cluster_paths "$NB")
ProctrackType=proctrack/linuxproc
$node
PartitionName=neighbour Nodes=localhost Default=YES State=UP
EOF
    SLURM_CONF=$NB/slurm.conf /usr/sbin/slurmctld 9>&- || die "the neighbour's slurmctld did not start"
    SLURM_CONF=$NB/slurm.conf /usr/sbin/slurmd -N localhost 9>&- || die "the neighbour's slurmd did not start"
fi

/usr/sbin/slurmctld 9>&- || die "slurmctld did not start (see $D/log/slurmctld.log)"
/usr/sbin/slurmd -N localhost 9>&- || die "slurmd did not start (see $D/log/slurmd.log)"
for _ in $(seq 60); do
    idle "$SLURM_CONF" debug && { [ -z "$NB" ] || idle "$NB/slurm.conf" neighbour; } && break
    sleep 0.5
done
# partition debug, not neighbour: the tier's commands reach its own controller
idle "$SLURM_CONF" debug || die "the node did not become idle: $(sinfo -h -o '%R %T %E' 2>&1)"
[ -z "$NB" ] || idle "$NB/slurm.conf" neighbour \
    || die "the neighbour's node did not become idle: $(SLURM_CONF=$NB/slurm.conf sinfo -h -o '%R %T %E' 2>&1)"
say "cluster up after ${SECONDS}s: $(sinfo -h -o '%N %T %c CPUs %m MB')"
[ -z "$NB" ] || say "a neighbour cluster runs on ports 6817/6818 (pids $(cat "$NB/slurmctld.pid") $(cat \
    "$NB/slurmd.pid")); this tier's cluster uses ports $CTLD_PORT/$SLURMD_PORT"

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
if [ -n "$NB" ]; then  # the tier must not have disturbed its neighbour
    pid=$(cat "$NB/slurmctld.pid" 2>/dev/null || true)
    if [ "$(cat "/proc/${pid:-0}/comm" 2>/dev/null)" != slurmctld ]; then
        rc=1
        say "FAILED: the neighbour's slurmctld (pid ${pid:-?}) is gone"
    elif ! idle "$NB/slurm.conf" neighbour; then
        rc=1
        say "FAILED: the neighbour cluster no longer answers: $(SLURM_CONF=$NB/slurm.conf sinfo -h -o '%R %T %E' 2>&1)"
    else
        say "the neighbour cluster still answers: $(SLURM_CONF=$NB/slurm.conf sinfo -h -o '%R %N %T')"
    fi
    stop_daemons "$NB"
fi
stop_daemons "$D"
[ -z "$stale" ] || { rc=1; say "FAILED: the jobs left files in /dev/shm:"; echo "$stale"; }
[ "$rc" = 0 ] && say "passed in ${SECONDS}s" || say "FAILED (rc $rc) after ${SECONDS}s"
exit "$rc"

#!/usr/bin/env bash
# local-cluster.sh: a single-node Slurm cluster on this machine, for tests and trying jobs.
#
#   jobs/local-cluster.sh up       install (if missing) and start munge, slurmctld, slurmd
#   jobs/local-cluster.sh status   daemons, partition and node state; exit 1 unless usable
#   jobs/local-cluster.sh down     stop what `up` started; safe to run twice
#
# Root only. Debian packages (slurmctld, slurmd, slurm-client, munge) are installed with
# apt-get only when a command is missing. There is no systemd here, so the daemons are
# started directly, with pid files under $OPTCC_SLURM_RUN (default /run/optcc-slurm).
#
# The node declares OPTCC_SLURM_CPUS (default 8) CPUs whatever the hardware has, with
# SlurmdParameters=config_overrides, so an 8-rank job fits on a 2-core machine (the ranks
# then share the cores: set MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 for MPICH, as the job
# scripts do). MpiDefault=none: launch MPI steps with `srun --mpi=pmi2` (MPICH) or
# `srun --mpi=pmix` (Open MPI; `up` makes Debian's PMIx plugin loadable, see enable_pmix).
#
# /etc/slurm/slurm.conf is written with a marker line and replaced only if it carries that
# marker (or is absent): a configuration that someone else wrote is never overwritten
# (OPTCC_SLURM_FORCE=1 overrides, keeping a backup). munged is stopped by `down` only if
# `up` started it.

set -euo pipefail

prog=local-cluster
die() { echo "$prog: error: $*" >&2; exit 2; }
say() { echo "$prog: $*"; }

CONF=/etc/slurm/slurm.conf
MARKER="# managed by optcc_mpi jobs/local-cluster.sh"
RUN=${OPTCC_SLURM_RUN:-/run/optcc-slurm}
STATE=${OPTCC_SLURM_STATE:-/var/lib/optcc-slurm}
LOGS=${OPTCC_SLURM_LOGS:-/var/log/optcc-slurm}
CPUS=${OPTCC_SLURM_CPUS:-8}
PARTITION=${OPTCC_SLURM_PARTITION:-debug}

need_root() { [[ $(id -u) == 0 ]] || die "needs root (it installs packages and starts daemons)"; }

# pid_of NAME: the pid in $RUN/NAME.pid if that process is alive and is NAME, else nothing.
# Checking /proc/PID/comm guards against a recycled pid.
pid_of() {
    local f=$RUN/$1.pid pid comm
    [[ -s "$f" ]] || return 1
    pid=$(< "$f")
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    comm=$(cat "/proc/$pid/comm" 2> /dev/null) || return 1
    [[ "$comm" == "$1" ]] || return 1
    echo "$pid"
}

install_packages() {
    local missing=()
    command -v slurmctld > /dev/null || missing+=(slurmctld)
    command -v slurmd > /dev/null || missing+=(slurmd)
    command -v sbatch > /dev/null || missing+=(slurm-client)
    command -v munged > /dev/null || missing+=(munge)
    [[ ${#missing[@]} -eq 0 ]] && return 0
    command -v apt-get > /dev/null || die "missing ${missing[*]} and no apt-get to install them"
    say "installing ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq > /dev/null || die "apt-get update failed"
    # Package scripts try to start services; without systemd they only warn.
    apt-get install -y -qq "${missing[@]}" > "$LOGS/apt.log" 2>&1 \
        || { tail -n 20 "$LOGS/apt.log" >&2; die "apt-get install ${missing[*]} failed"; }
}

# Slurm's PMIx plugin (srun --mpi=pmix, which Open MPI 5 needs: it speaks no PMI-2) opens
# libpmix.so from Debian's pmix2 folder. Debian ships the library in libpmix2 but the
# unversioned name only in libpmix-dev (with autotools and a dozen -dev packages); a link
# beside the library is all the plugin needs. Best effort: MPICH jobs use pmi2 anyway.
enable_pmix() {
    local plugin dir
    plugin=$(ls /usr/lib/*/slurm-wlm/mpi_pmix.so 2> /dev/null | head -n 1 || true)
    [[ -n "$plugin" ]] || return 0
    dir=$(dirname "$(dirname "$plugin")")/pmix2/lib
    if [[ ! -e "$dir/libpmix.so.2" ]] && command -v apt-get > /dev/null; then
        say "installing libpmix2 (for srun --mpi=pmix)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libpmix2 >> "$LOGS/apt.log" 2>&1 \
            || { say "warning: libpmix2 not installed; srun --mpi=pmix will not work"; return 0; }
    fi
    if [[ -e "$dir/libpmix.so.2" && ! -e "$dir/libpmix.so" ]]; then
        ln -s libpmix.so.2 "$dir/libpmix.so"
    fi
}

start_munge() {
    if [[ ! -s /etc/munge/munge.key ]]; then
        say "creating the munge key"
        if command -v mungekey > /dev/null; then
            mungekey --create --keyfile=/etc/munge/munge.key
        else
            dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
        fi
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    # munged already answering (started by someone else, or by an earlier `up`): reuse it.
    if munge -n > /dev/null 2>&1 </dev/null; then
        return 0
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged \
        || die "munged did not start (see /var/log/munge/munged.log)"
    # munged keeps its pid file in /run/munge as the munge user; a copy in $RUN marks it as
    # ours, so that `down` stops it and nothing else.
    local i
    for i in $(seq 50); do
        [[ -s /run/munge/munged.pid ]] && break
        sleep 0.1
    done
    cp -f /run/munge/munged.pid "$RUN/munged.pid" 2> /dev/null || true
    for i in $(seq 50); do
        munge -n > /dev/null 2>&1 </dev/null && return 0
        sleep 0.1
    done
    die "munged started but does not answer"
}

write_conf() {
    local host=$1
    if [[ -e "$CONF" ]] && ! grep -qF "$MARKER" "$CONF"; then
        if [[ "${OPTCC_SLURM_FORCE:-0}" == 1 ]]; then
            cp -p "$CONF" "$CONF.optcc-backup.$(date +%s)"
            say "replacing $CONF (backup kept beside it)"
        else
            die "$CONF exists and was not written by this script; move it away or set OPTCC_SLURM_FORCE=1"
        fi
    fi
    mkdir -p "$(dirname "$CONF")"
    cat > "$CONF" << EOF
$MARKER
# A single-node cluster for tests: the node declares $CPUS CPUs (config_overrides).
ClusterName=optcclocal
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
KillWait=10
MinJobAge=300
NodeName=$host NodeAddr=127.0.0.1 CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=16000 State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

start_daemon() {
    local name=$1 pid
    if pid=$(pid_of "$name"); then
        say "$name already running (pid $pid)"
        return 0
    fi
    "/usr/sbin/$name" -f "$CONF" >> "$LOGS/$name.stderr" 2>&1 \
        || die "$name did not start; see $LOGS/$name.log and $LOGS/$name.stderr"
}

wait_ready() {
    local host=$1 i state
    for i in $(seq 60); do
        state=$(sinfo -h -n "$host" -o %T 2> /dev/null | head -n 1 || true)
        case "$state" in
        idle* | mixed* | allocated* | completing*) say "ready: node $host is $state"; return 0 ;;
        down* | drain*)
            scontrol update nodename="$host" state=resume > /dev/null 2>&1 || true ;;
        esac
        sleep 1
    done
    die "the node did not become idle in 60 s (state '${state:-unknown}'); see $LOGS/"
}

cmd_up() {
    need_root
    mkdir -p "$RUN" "$STATE/state" "$STATE/spool" "$LOGS"
    install_packages
    enable_pmix
    local host
    host=$(hostname -s)
    write_conf "$host"
    start_munge
    start_daemon slurmctld
    # slurmd registers with slurmctld: give the controller a moment to listen.
    local i
    for i in $(seq 30); do
        scontrol ping 2> /dev/null | grep -q UP && break
        sleep 0.5
    done
    start_daemon slurmd
    wait_ready "$host"
}

stop_pid() {
    local name=$1 pid i
    pid=$(pid_of "$name") || { rm -f "$RUN/$name.pid"; return 0; }
    kill -TERM "$pid" 2> /dev/null || true
    for i in $(seq 100); do
        kill -0 "$pid" 2> /dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2> /dev/null; then
        kill -KILL "$pid" 2> /dev/null || true
    fi
    rm -f "$RUN/$name.pid"
    say "stopped $name (pid $pid)"
}

cmd_down() {
    need_root
    # Jobs first, so that slurmd does not leave orphans behind.
    if pid_of slurmctld > /dev/null && command -v scancel > /dev/null; then
        scancel --full --quiet -u root > /dev/null 2>&1 || true
    fi
    stop_pid slurmd
    stop_pid slurmctld
    stop_pid munged  # only if `up` started it (pid file of ours)
}

cmd_status() {
    local ok=0 name pid
    for name in munged slurmctld slurmd; do
        if pid=$(pid_of "$name"); then
            say "$name running (pid $pid)"
        elif [[ "$name" == munged ]] && munge -n > /dev/null 2>&1 </dev/null; then
            say "munged running (not started by this script)"
        else
            say "$name not running"
            ok=1
        fi
    done
    if [[ $ok == 0 ]] && command -v sinfo > /dev/null; then
        sinfo -o "%P %a %D %T %c %N" || ok=1
    fi
    return $ok
}

case "${1:-}" in
up) cmd_up ;;
down) cmd_down ;;
status) cmd_status ;;
*) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac

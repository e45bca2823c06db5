#!/usr/bin/env bash
# degrade-wrapper.sh: turn chosen ranks of an MPI job into stragglers, then run the command.
#
#   srun --mpi=pmi2 -n 8 jobs/degrade-wrapper.sh .venv/bin/python -m optcc_mpi bench ...
#
# Every rank runs this wrapper. A rank is a straggler when its SLURM_PROCID is listed in
# OPTCC_STRAGGLER_PROCIDS or its SLURM_NODEID in OPTCC_STRAGGLER_NODEIDS (comma lists, ranges
# allowed: "0,3", "4-7"). Other ranks exec the command with the environment untouched.
# The rank is PMI_RANK / OMPI_COMM_WORLD_RANK / PMIX_RANK when the launcher sets one (they
# equal SLURM_PROCID under srun), else SLURM_PROCID.
#
# How a straggler is slowed, OPTCC_DEGRADE_METHOD (default: ucx when
# OPTCC_STRAGGLER_NET_DEVICES is set, else emulate):
#   ucx      UCX_NET_DEVICES=$OPTCC_STRAGGLER_NET_DEVICES, e.g. "mlx5_0:1": the rank may use
#            only those NICs (a node with 4 rails restricted to 1 has a quarter of the
#            bandwidth). Works for MPI over UCX (MPICH ch4:ucx, Open MPI pml ucx).
#   emulate  OPTCC_EMULATE_FRACTION=$OPTCC_STRAGGLER_FRACTION (default 0.5): optcc_mpi's
#            executor paces this rank's virtual NIC at that fraction of the OPTCC_EMULATE
#            bandwidth. No root, any interconnect; needs OPTCC_EMULATE set for the job.
#   tc       tbf on interface OPTCC_TC_DEV (root only) at OPTCC_TC_RATE, or at the fraction
#            of the NIC's speed from /sys/class/net/DEV/speed. Shapes the node's egress on
#            that interface (all ranks of the node), so choose stragglers by node id.
#            RDMA (InfiniBand verbs, RoCE, Slingshot) bypasses tc: only TCP traffic slows.
#            Local rank 0 removes the qdisc when its command ends (OPTCC_TC_KEEP=1 keeps it).
#
# Other knobs: OPTCC_TC_BURST (tbf bucket, default 2 ms of the rate, at least 64kb),
# OPTCC_TC_LATENCY (default 50ms), OPTCC_DEGRADE_DRYRUN=1 (print the tc commands instead of
# running them), OPTCC_DEGRADE_QUIET=1 (no log line). Stragglers also get OPTCC_STRAGGLER=1.
# Check the logic without Slurm:  SLURM_PROCID=3 OPTCC_STRAGGLER_PROCIDS=3 ./degrade-wrapper.sh env

set -euo pipefail

prog=degrade-wrapper
die() { echo "$prog: error: $*" >&2; exit 2; }
say() { [[ "${OPTCC_DEGRADE_QUIET:-0}" == 1 ]] || echo "$prog: $*" >&2; }

[[ $# -ge 1 ]] || die "usage: degrade-wrapper.sh COMMAND [ARGS...] (see the header of this file)"

# in_list ID LIST: is ID in a comma list of integers and ranges ("0,3,5-7")?
in_list() {
    local id=$1 item lo hi
    local -a items
    IFS=',' read -r -a items <<< "${2// /}"
    for item in "${items[@]}"; do
        [[ -z "$item" ]] && continue
        if [[ "$item" =~ ^([0-9]+)-([0-9]+)$ ]]; then
            lo=${BASH_REMATCH[1]} hi=${BASH_REMATCH[2]}
            (( lo <= hi )) || die "bad range '$item' in '$2'"
            (( 10#$id >= 10#$lo && 10#$id <= 10#$hi )) && return 0
        elif [[ "$item" =~ ^[0-9]+$ ]]; then
            (( 10#$id == 10#$item )) && return 0
        else
            die "'$item' in '$2' is not a rank, node id or range"
        fi
    done
    return 1
}

procids=${OPTCC_STRAGGLER_PROCIDS:-}
nodeids=${OPTCC_STRAGGLER_NODEIDS:-}
if [[ -z "$procids" && -z "$nodeids" ]]; then
    exec "$@"  # nothing to degrade: behave as if the wrapper were not there
fi

# The launcher's own rank variable first: under `mpiexec` inside an sbatch allocation every
# rank inherits the batch step's SLURM_PROCID=0. Under srun the two agree.
procid=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-${SLURM_PROCID:-}}}}
nodeid=${SLURM_NODEID:-}
localid=${SLURM_LOCALID:-${MPI_LOCALRANKID:-${OMPI_COMM_WORLD_LOCAL_RANK:-0}}}

straggler=0
if [[ -n "$procids" ]]; then
    # A misconfigured experiment that silently runs healthy would mislead: fail instead.
    [[ "$procid" =~ ^[0-9]+$ ]] || die "OPTCC_STRAGGLER_PROCIDS is set but this process's rank is unknown (no SLURM_PROCID/PMI_RANK); run it under srun"
    in_list "$procid" "$procids" && straggler=1
fi
if [[ -n "$nodeids" ]]; then
    [[ "$nodeid" =~ ^[0-9]+$ ]] || die "OPTCC_STRAGGLER_NODEIDS is set but SLURM_NODEID is not; run it under srun"
    in_list "$nodeid" "$nodeids" && straggler=1
fi
if [[ $straggler == 0 ]]; then
    exec "$@"
fi

fraction=${OPTCC_STRAGGLER_FRACTION:-0.5}
awk -v f="$fraction" 'BEGIN { exit !(f ~ /^[0-9]*\.?[0-9]+$/ && f > 0 && f <= 1) }' \
    || die "OPTCC_STRAGGLER_FRACTION='$fraction' must be a number in (0, 1]"

method=${OPTCC_DEGRADE_METHOD:-}
if [[ -z "$method" ]]; then
    if [[ -n "${OPTCC_STRAGGLER_NET_DEVICES:-}" ]]; then method=ucx; else method=emulate; fi
fi
who="rank ${procid:-?} (node ${nodeid:-?}, local $localid)"
export OPTCC_STRAGGLER=1

case "$method" in
ucx)
    [[ -n "${OPTCC_STRAGGLER_NET_DEVICES:-}" ]] \
        || die "method ucx needs OPTCC_STRAGGLER_NET_DEVICES (e.g. mlx5_0:1; list with ucx_info -d)"
    export UCX_NET_DEVICES="$OPTCC_STRAGGLER_NET_DEVICES"
    say "$who is a straggler: UCX_NET_DEVICES=$UCX_NET_DEVICES"
    exec "$@"
    ;;
emulate)
    export OPTCC_EMULATE_FRACTION="$fraction"
    say "$who is a straggler: OPTCC_EMULATE_FRACTION=$fraction"
    [[ -n "${OPTCC_EMULATE:-}" ]] \
        || say "warning: OPTCC_EMULATE is not set, so OPTCC_EMULATE_FRACTION has no effect"
    exec "$@"
    ;;
tc)
    ;;
*)
    die "OPTCC_DEGRADE_METHOD='$method' is not one of ucx, emulate, tc"
    ;;
esac

# ---- tc: shape the node's egress on one interface, run the command, then clean up.
dev=${OPTCC_TC_DEV:-}
[[ -n "$dev" ]] || die "method tc needs OPTCC_TC_DEV (the interface MPI's TCP traffic uses)"
dryrun=${OPTCC_DEGRADE_DRYRUN:-0}
if [[ "$dryrun" != 1 ]]; then
    [[ $(id -u) == 0 ]] || die "method tc needs root (tc qdisc on $dev); use ucx or emulate instead"
    command -v tc > /dev/null || die "tc not found (install iproute2)"
    [[ -e "/sys/class/net/$dev" ]] || die "no interface '$dev' on $(hostname)"
fi

# Rate in bit/s: OPTCC_TC_RATE (tc-style: 400mbit, 10gbit, 50mbps) or fraction x NIC speed.
to_bits() {
    awk -v r="$1" 'BEGIN {
        r = tolower(r)
        if (!match(r, /^[0-9]*\.?[0-9]+/)) exit 1
        v = substr(r, 1, RLENGTH); u = substr(r, RLENGTH + 1)
        m["bit"] = 1; m[""] = 1; m["kbit"] = 1e3; m["mbit"] = 1e6; m["gbit"] = 1e9
        m["bps"] = 8; m["kbps"] = 8e3; m["mbps"] = 8e6; m["gbps"] = 8e9
        if (!(u in m)) exit 1
        printf "%.0f\n", v * m[u]
    }'
}
if [[ -n "${OPTCC_TC_RATE:-}" ]]; then
    rate_bit=$(to_bits "$OPTCC_TC_RATE") || die "OPTCC_TC_RATE='$OPTCC_TC_RATE' is not a rate (e.g. 10gbit)"
else
    speed=$(cat "/sys/class/net/$dev/speed" 2> /dev/null || echo -1)
    [[ "$speed" =~ ^[0-9]+$ && "$speed" -gt 0 ]] \
        || die "cannot read the speed of $dev; set OPTCC_TC_RATE (e.g. 10gbit)"
    rate_bit=$(awk -v s="$speed" -v f="$fraction" 'BEGIN { printf "%.0f\n", s * 1e6 * f }')
fi
(( rate_bit >= 8000 )) || die "tc rate $rate_bit bit/s is too low"
burst=${OPTCC_TC_BURST:-$(awk -v r="$rate_bit" 'BEGIN { b = r / 8 / 500; if (b < 65536) b = 65536; printf "%.0fb\n", b }')}
latency=${OPTCC_TC_LATENCY:-50ms}
shape=(tc qdisc replace dev "$dev" root tbf rate "${rate_bit}bit" burst "$burst" latency "$latency")
unshape=(tc qdisc del dev "$dev" root)

# Every straggler rank of the node runs the same idempotent `replace`; no lock needed.
if [[ "$dryrun" == 1 ]]; then
    echo "$prog: dry run: ${shape[*]}" >&2
else
    "${shape[@]}" || die "'${shape[*]}' failed"
fi
say "$who is a straggler: tbf ${rate_bit}bit on $dev (egress; RDMA traffic is not affected)"

cleanup() {
    if [[ "${OPTCC_TC_KEEP:-0}" != 1 && "$localid" == 0 ]]; then
        if [[ "$dryrun" == 1 ]]; then
            echo "$prog: dry run: ${unshape[*]}" >&2
        else
            "${unshape[@]}" 2> /dev/null || true
        fi
    fi
}
# Run the command as a child so the qdisc can be removed afterwards; pass signals on.
set +e
"$@" &
child=$!
trap 'kill -TERM "$child" 2> /dev/null' TERM INT HUP
wait "$child"
status=$?
# `wait` returns early when a trapped signal arrives: wait again for the real exit status.
while kill -0 "$child" 2> /dev/null; do
    wait "$child"
    status=$?
done
cleanup
exit "$status"

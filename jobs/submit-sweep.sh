#!/usr/bin/env bash
# submit-sweep.sh: submit a sweep table as a Slurm job array, one task per table row.
#
#   jobs/submit-sweep.sh TABLE.csv [--wait] [--only-failed RESULTS] [--results DIR]
#                        [--dry-run] [--] [sbatch options...]
#
#   TABLE.csv            sweep table; its `kind` column (allreduce, casgd), or else its
#                        header, picks jobs/allreduce-sweep.sbatch or jobs/casgd-sweep.sbatch
#   --wait               block until every task has finished, print the summary, and exit
#                        1 if any task failed or left no record
#   --only-failed DIR    resubmit only the tasks of this table whose latest run in results
#                        folder DIR failed or left no record (results go to DIR as well)
#   --results DIR        results folder (default: $OPTCC_RESULTS, else ./results)
#   --dry-run            print the sbatch command instead of running it
#   sbatch options       passed on, e.g. --partition=gpu --account=abc --time=02:00:00
#                        --nodes=2 --ntasks-per-node=4 (they override the script's)
#
# The job gets --array from the table's rows, --ntasks from its largest `ranks` (unless you
# pass -n/--ntasks/--ntasks-per-node), --output=RESULTS/logs/%x_%A_%a.out, and the
# environment OPTCC_TABLE, OPTCC_RESULTS and OPTCC_HOME. A manifest-<job id>.json in the
# results folder records the submission, so `optcc-mpi report` can name tasks that never
# reported. Python comes from $OPTCC_PYTHON, else $OPTCC_VENV/bin/python (default: .venv of
# this repository, with MPICH; OPTCC_VENV=$PWD/.venv-ompi runs the sweep under Open MPI),
# else python3; the jobs inherit the choice, and the launcher follows the MPI that Python's
# mpi4py loads (srun --mpi=pmi2 for MPICH, --mpi=pmix for Open MPI). See docs/slurm.md.

set -euo pipefail

prog=submit-sweep
die() { echo "$prog: error: $*" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
home=$(cd "$here/.." && pwd)

table=""
wait=0
only_failed=""
results=${OPTCC_RESULTS:-}
dry=0
sbatch_opts=()
while [[ $# -gt 0 ]]; do
    case "$1" in
    --wait) wait=1 ;;
    --only-failed) [[ $# -ge 2 ]] || die "--only-failed needs a results folder"; only_failed=$2; shift ;;
    --only-failed=*) only_failed=${1#*=} ;;
    --results) [[ $# -ge 2 ]] || die "--results needs a folder"; results=$2; shift ;;
    --results=*) results=${1#*=} ;;
    --dry-run) dry=1 ;;
    -h | --help) sed -n '2,/^$/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;;
    --) shift; sbatch_opts+=("$@"); break ;;
    *)
        if [[ -z "$table" && "$1" != -* ]]; then table=$1; else sbatch_opts+=("$1"); fi
        ;;
    esac
    shift
done
[[ -n "$table" ]] || die "usage: submit-sweep.sh TABLE.csv [--wait] [--only-failed RESULTS] [sbatch options]"
[[ -f "$table" ]] || die "no table $table"

# Python with optcc_mpi: the one the jobs will use too.
venv=${OPTCC_VENV:-$home/.venv}
if [[ -n "${OPTCC_PYTHON:-}" ]]; then
    py=$OPTCC_PYTHON
elif [[ -x "$venv/bin/python" ]]; then
    py=$venv/bin/python
else
    py=$(command -v python3) || die "no Python found; set OPTCC_PYTHON or OPTCC_VENV"
fi

if [[ -n "$only_failed" ]]; then
    [[ -d "$only_failed" ]] || die "no results folder $only_failed"
    results=${results:-$only_failed}
fi
results=${results:-$PWD/results}
mkdir -p "$results/logs"
results=$(cd "$results" && pwd)

# plan: kind, script, table (absolute), rows, count, array, max_ranks as shell assignments;
# every value is shell-quoted by Python, so eval is safe here.
plan_args=(plan "$table" --shell)
[[ -n "$only_failed" ]] && plan_args+=(--only-failed "$only_failed")
plan=$("$py" -m optcc_mpi sweep "${plan_args[@]}") || die "cannot read $table (see above)"
kind="" script="" name="" count=0 array="" max_ranks=1 rows=0
eval "$plan"
table_abs=$table  # the plan's `table` is the resolved absolute path

if [[ "$count" == 0 ]]; then
    echo "$prog: nothing to submit: every task of $name has a successful record in $results"
    exit 0
fi

# --ntasks from the table, unless the caller sizes the job.
has_ntasks=0
for opt in "${sbatch_opts[@]+"${sbatch_opts[@]}"}"; do
    case "$opt" in
    -n | -n* | --ntasks | --ntasks=* | --ntasks-per-node | --ntasks-per-node=*) has_ntasks=1 ;;
    esac
done
cmd=(sbatch --parsable --array="$array" --output="$results/logs/%x_%A_%a.out")
(( has_ntasks )) || cmd+=(--ntasks="$max_ranks")
cmd+=("${sbatch_opts[@]+"${sbatch_opts[@]}"}" "$here/$script" "$table_abs")

export OPTCC_TABLE=$table_abs OPTCC_RESULTS=$results OPTCC_HOME=$home
if (( dry )); then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
command -v sbatch > /dev/null || die "sbatch not found: is Slurm installed (jobs/local-cluster.sh up)?"
out=$("${cmd[@]}") || die "sbatch failed"
job=${out%%;*}  # --parsable prints "jobid" or "jobid;cluster"
[[ "$job" =~ ^[0-9]+$ ]] || die "unexpected sbatch output: $out"
"$py" -m optcc_mpi sweep manifest --results "$results" --table "$table_abs" --job "$job" \
    --tasks "$array" --script "$script" -- "${cmd[@]}" > /dev/null
echo "$prog: submitted $name ($kind, $count of $rows tasks: --array=$array) as job $job; results in $results"

(( wait )) || exit 0
# Poll rather than `sbatch --wait`, so the manifest is written before the wait begins.
# squeue forgets a finished job after MinJobAge, and then fails: also "finished".
while q=$(squeue -h -j "$job" -o %i 2> /dev/null) && [[ -n "$q" ]]; do
    sleep "${OPTCC_POLL_S:-3}"
done
"$py" -m optcc_mpi sweep status "$results" --job "$job"

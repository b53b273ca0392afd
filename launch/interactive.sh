#!/bin/bash
# eprt in an interactive SLURM allocation: get nodes once, then start eprt as often as you like.
#
# 1. Get an allocation (one task per GPU; here 2 nodes with 8 GPUs each, for an hour):
#
#      salloc --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=8 --time=01:00:00
#
# 2. Inside the shell salloc opens, start eprt with this script, through srun (the default):
#
#      launch/interactive.sh serve --model /models/my-moe --port 8000
#      launch/interactive.sh generate --model /models/my-moe --prompt "Hello"
#
#    or through your MPI's own launcher, which finds the allocation's nodes by itself:
#
#      launch/interactive.sh --mpirun run --model /models/my-moe --input in.jsonl --output out.jsonl
#
# Rank 0 runs on the first node of the allocation: with `serve --host 0.0.0.0`, reach it at
# http://<first node>:8000 (or tunnel: ssh -L 8000:<first node>:8000 <login node>).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [[ -z ${SLURM_JOB_ID:-} ]]; then
    echo "interactive.sh: not inside a SLURM allocation; get one first, e.g.:" >&2
    echo "  salloc --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=8 --time=01:00:00" >&2
    exit 2
fi

launcher=srun
if [[ ${1:-} == "--mpirun" ]]; then
    launcher=mpirun
    shift
fi
if (($# == 0)); then
    echo "usage: launch/interactive.sh [--mpirun] EPRT_COMMAND [ARGS ...]" >&2
    exit 2
fi

ranks=${SLURM_NTASKS:?the allocation does not say how many tasks it has (give salloc --ntasks-per-node)}
first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
echo "interactive.sh: $ranks ranks on ${SLURM_NNODES:-?} nodes; rank 0 on $first_node" >&2

if [[ $launcher == srun ]]; then
    exec srun --mpi=pmix --ntasks="$ranks" --kill-on-bad-exit=1 eprt "$@"
fi
# Open MPI and MPICH both read the node list from SLURM; eprt-mpirun adds the per-node layout.
layout=(-n "$ranks")
if [[ -n ${SLURM_NTASKS_PER_NODE:-} ]]; then     # set when salloc got --ntasks-per-node
    layout+=(--ranks-per-node "$SLURM_NTASKS_PER_NODE")
fi
exec "$here/eprt-mpirun" "${layout[@]}" -- "$@"

#!/usr/bin/env bash
# Start N local processes of one mx_jax training run, joined by jax.distributed (coordinator on loopback).
#
#   launch/local.sh N [--cpu-devices K | --gpus-per-process G] --config configs/X.yaml [key=value ...]
#
# Each process runs `python -m mx_jax.train` ($PYTHON where set) with MX_JAX_COORDINATOR / MX_JAX_NUM_PROCESSES /
# MX_JAX_PROCESS_ID.
# --cpu-devices K gives each process K fake CPU devices (testing multi-host logic on one machine).
# --gpus-per-process G gives process i the i-th G of the machine's GPUs (of $CUDA_VISIBLE_DEVICES where set), through
# CUDA_VISIBLE_DEVICES: a GPU machine stands in for N hosts of G GPUs (launch/slurm.sbatch with --ntasks-per-node=8
# splits a node the same way).
# Without either, every process sees every GPU, which only suits one process (N = 1).
# Process 0's output goes to the terminal, process i's to $MX_JAX_LOG_DIR/proc<i>.log (default: a fresh
# /tmp/mx_jax_local.XXXX directory, named on failure). Any failure stops all (SIGKILL: after
# jax.distributed.initialize a process takes SIGTERM as a preemption notice, not as an order to die). The processes
# run in the background, so Ctrl-C reaches only this script: the first SIGINT or SIGTERM is passed on as SIGTERM
# (every process saves the same step and exits 143, mx_jax/preemption.py), a second one as SIGKILL.
# The exit code is the first failing process's (143 after a preemption stop), 0 if all succeeded.
set -euo pipefail
if [[ $# -lt 1 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 N [--cpu-devices K | --gpus-per-process G] --config configs/X.yaml [key=value ...]" >&2
  exit 2
fi
n=$1; shift
cpu_devices=""
gpus_each=""
if [[ "${1:-}" == "--cpu-devices" ]]; then
  cpu_devices=${2:-}; shift; [[ $# -gt 0 ]] && shift
  if [[ ! "$cpu_devices" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: --cpu-devices takes a positive number of fake CPU devices per process, got '$cpu_devices'" >&2
    exit 2
  fi
fi
if [[ "${1:-}" == "--gpus-per-process" ]]; then
  gpus_each=${2:-}; shift; [[ $# -gt 0 ]] && shift
  if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    IFS=, read -r -a gpus <<< "$CUDA_VISIBLE_DEVICES"
  else
    mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null || true)
  fi
  if [[ ! "$gpus_each" =~ ^[1-9][0-9]*$ || $((n * gpus_each)) -gt ${#gpus[@]} ]]; then
    echo "error: --gpus-per-process $gpus_each for $n processes needs $n x $gpus_each GPUs; this machine shows" \
         "${#gpus[@]} (nvidia-smi, or CUDA_VISIBLE_DEVICES where set)" >&2
    exit 2
  fi
fi
port=${MX_JAX_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
logdir=${MX_JAX_LOG_DIR:-$(mktemp -d /tmp/mx_jax_local.XXXX)}
mkdir -p "$logdir"
pids=()
stop_all() { for p in "${pids[@]}"; do kill "-$1" "$p" 2>/dev/null || true; done; }
signalled=0
on_signal() { if [[ $signalled -eq 0 ]]; then signalled=1; stop_all TERM; else stop_all KILL; fi; }
trap on_signal INT TERM
for ((i = 0; i < n; i++)); do
  env=(MX_JAX_COORDINATOR="127.0.0.1:$port" MX_JAX_NUM_PROCESSES="$n" MX_JAX_PROCESS_ID="$i")
  if [[ -n "$cpu_devices" ]]; then env+=(MX_JAX_CPU_DEVICES="$cpu_devices" JAX_PLATFORMS=cpu); fi
  if [[ -n "$gpus_each" ]]; then
    mine=("${gpus[@]:$((i * gpus_each)):$gpus_each}")
    env+=(CUDA_VISIBLE_DEVICES="$(IFS=,; echo "${mine[*]}")")
  fi
  if [[ $i -eq 0 ]]; then
    env "${env[@]}" "${PYTHON:-python}" -m mx_jax.train "$@" &
  else
    env "${env[@]}" "${PYTHON:-python}" -m mx_jax.train "$@" > "$logdir/proc$i.log" 2>&1 &
  fi
  pids+=($!)
done
status=0
# Processes are collected as they end, in any order: one that fails while another still waits for it (in
# jax.distributed.initialize, or a collective) stops all at once. (bash reaps its children as they exit, so
# `kill -0` fails for one that has ended; `wait` then gives its status.)
left=("${pids[@]}")
while [[ ${#left[@]} -gt 0 ]]; do
  running=()
  for p in "${left[@]}"; do
    if kill -0 "$p" 2>/dev/null; then running+=("$p"); continue; fi
    rc=0; wait "$p" || rc=$?
    [[ $rc -ne 0 && $status -eq 0 ]] && status=$rc
    [[ $rc -eq 0 || $rc -eq 143 ]] || stop_all KILL  # a failure stops all; a preemption stop ends each by itself
  done
  left=("${running[@]+"${running[@]}"}")
  [[ ${#left[@]} -eq 0 ]] || sleep 0.2
done
if [[ $status -ne 0 && $status -ne 143 && $n -gt 1 ]]; then
  echo "a process failed; logs of processes 1..$((n - 1)) in $logdir" >&2
fi
exit $status

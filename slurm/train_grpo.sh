#!/usr/bin/env bash
# GRPO on a Slurm allocation. Several nodes: the config checked on the head node (the launcher's
# --print-config), a Ray cluster over the allocated nodes (head on the first node, workers on the
# rest, each started with srun), a wait until every node has registered with its GPUs, then
# `python -m mlrl.launch --nodes $SLURM_NNODES --config ...` on the head node. One node: the local
# launcher alone, no Ray.
#
#   sbatch slurm/train_grpo.sh                                   # launch/qwen3_8b_grpo.yaml
#   MLRL_CONFIG=launch/qwen3_30b_a3b_fp8.yaml sbatch slurm/train_grpo.sh trainer.lr=2e-6
#   MLRL_CONTAINER_IMAGE=/images/mlrl.sqsh sbatch slurm/train_grpo.sh   # pyxis/enroot container
#   sbatch --nodes=4 slurm/train_grpo.sh rollout.num_engines=8           # other sizes: plan first with
#                                                                        # python -m mlrl.launch --dry-run --nodes 4
#   MLRL_CONFIG=launch/cpu_default.yaml sbatch --nodes=1 --gpus-per-node=0 slurm/train_grpo.sh   # CPU smoke test
# Arguments are `a.b=c` config overrides passed to mlrl.launch.
#
# GPUs per node are what Slurm granted: SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE ("8" or
# "h100:8"), else none. An allocation without GPUs runs mlrl's CPU path: on several nodes, a Ray
# cluster whose nodes each offer MLRL_CPU_SLOTS_PER_NODE logical device slots (Ray "GPU"
# resources with no CUDA behind them: every trainer rank and engine placed on one takes its CPU
# path).
#
# Environment (all optional):
#   MLRL_CONFIG             recipe (default: launch/qwen3_8b_grpo.yaml)
#   MLRL_CONTAINER_IMAGE    run every step in this image (srun --container-image, needs pyxis)
#   MLRL_CONTAINER_MOUNTS   srun --container-mounts (default: the submit directory at the same path)
#   MLRL_PYTHON             python executable on the nodes (default: python); `ray` is taken from
#                           the same folder when this is a path, so both come from one environment
#   MLRL_GPUS_PER_NODE      override the GPU count read from Slurm
#   MLRL_CPU_SLOTS_PER_NODE device slots per node of a multi-node allocation without GPUs (default: 1)
#   MLRL_RAY_PORT           Ray GCS port on the head node (default: 6379)
#   MLRL_RAY_WAIT_S         seconds to wait for the head to listen, then for all nodes to register (default: 600 each)
#   MLRL_SLURM_DRY_RUN=1    print the srun / ray / launch commands instead of running them
#
# Job steps after the first use --overlap: the Ray steps hold the nodes for the whole job. Steps
# that request no GPUs see the job's GPUs (Slurm's default), which is what `ray start` needs.
# Stopping a run: `scancel --batch --signal=TERM JOB` (or the time limit: --signal=B:TERM@180) has
# this script pass SIGTERM to the launcher step alone, which tears its engines, ranks and reward
# workers down in order and exits 143, and then stop Ray. A plain `scancel JOB` signals every step
# at once: on one node without GPUs (no Ray) the launcher still tears down in order and exits 143;
# on a Ray run, Ray goes down under the launcher, so it cannot stop its remote processes itself
# and Slurm ends them (KillWait later at most). Set KillWait above the teardown time (~20 s on CPU).
#SBATCH --job-name=mlrl-grpo
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:TERM@180
#SBATCH --output=%x-%j.out

set -euo pipefail

nnodes=${SLURM_NNODES:?not inside a Slurm allocation: SLURM_NNODES is unset (submit with sbatch)}
nodelist=${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is unset}
# What Slurm granted per node: "8", or "h100:8" in SLURM_GPUS_PER_NODE; nothing set = no GPUs.
granted=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}
granted=${granted##*:}
gpus_per_node=${MLRL_GPUS_PER_NODE:-$granted}
if ! [[ "$gpus_per_node" =~ ^[0-9]+$ ]]; then
  echo "train_grpo.sh: GPUs per node '$gpus_per_node' (from MLRL_GPUS_PER_NODE / SLURM_GPUS_ON_NODE /" \
       "SLURM_GPUS_PER_NODE) is not a whole number" >&2
  exit 1
fi
workdir=${SLURM_SUBMIT_DIR:-$PWD}
config=${MLRL_CONFIG:-launch/qwen3_8b_grpo.yaml}
python=${MLRL_PYTHON:-python}
if [[ "$python" == */* ]]; then
  ray=$(dirname "$python")/ray   # the same environment's ray (not PATH's)
else
  ray=ray
fi
slots=${MLRL_CPU_SLOTS_PER_NODE:-1}
ray_port=${MLRL_RAY_PORT:-6379}
wait_s=${MLRL_RAY_WAIT_S:-600}
dry=${MLRL_SLURM_DRY_RUN:-}

container=()
if [[ -n "${MLRL_CONTAINER_IMAGE:-}" ]]; then
  container=(--container-image="$MLRL_CONTAINER_IMAGE"
             --container-mounts="${MLRL_CONTAINER_MOUNTS:-$workdir:$workdir}"
             --container-workdir="$workdir")
fi

# Run a command, or print it shell-quoted (one line per command) in dry mode.
run() {
  if [[ -n "$dry" ]]; then
    printf '%q ' "$@"
    printf '\n'
  else
    "$@"
  fi
}

# Same, in the background (the long-running Ray steps), in a session of its own: a signal for
# this shell alone (`scancel --batch`, --signal=B:...) reaches its whole process group, and an
# srun client that gets SIGTERM kills its step at once; these steps are ended in order below.
run_bg() {
  if [[ -n "$dry" ]]; then
    printf '%q ' "$@"
    printf '&\n'
  else
    setsid "$@" &
  fi
}

ray_started=   # set once the Ray steps run: stopped in order at the end
launch_step=   # the launcher's job step, JOBID.STEP, once it runs

# This job's steps with the given name, as JOBID.STEP.
steps_named() {
  squeue -h -s -j "${SLURM_JOB_ID:-0}" -o "%i %j" 2>/dev/null | awk -v n="$1" '$2 == n {print $1}'
}

# Stop this job's Ray, workers first, then the head, while the head's GCS is still up: SIGTERM to
# each step (Ray drains the node and ends its processes). Not `ray stop`, which would end every
# Ray cluster on the node, other jobs' or other users' included.
stop_ray() {
  local name ids i
  for name in mlrl-ray-worker mlrl-ray-head; do
    mapfile -t ids < <(steps_named "$name")
    ((${#ids[@]})) || continue
    scancel --signal=TERM "${ids[@]}" 2>/dev/null || true
    for ((i = 0; i < 120; i++)); do
      [[ -n "$(steps_named "$name")" ]] || break
      sleep 0.5
    done
  done
}

# At exit: stop Ray in order, then end whatever background step is left.
cleanup() {
  local pids
  if [[ -n "$ray_started" ]]; then
    stop_ray
  fi
  mapfile -t pids < <(jobs -p)
  if ((${#pids[@]})); then
    kill "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
  fi
}
trap cleanup EXIT

# SIGTERM reaches this shell from a plain scancel (which signals every step at once), from
# `scancel --batch --signal=TERM` (this shell alone) and, before the time limit, from
# `#SBATCH --signal=B:TERM@180`. It is passed on to the launcher step alone, which tears its
# engines, ranks and reward workers down in order while Ray is still up and exits 143; then the
# Ray steps are stopped. A trapped signal is reset to the default in the steps started from here.
terminated=
on_term() {
  terminated=1
  if [[ -n "$launch_step" ]]; then
    scancel --signal=TERM "$launch_step" 2>/dev/null || true
  fi
}
trap on_term TERM
# Wait until HOST:PORT accepts a TCP connection (the Ray head's GCS, which the workers join), for
# at most TIMEOUT_S seconds, each try at most 2 s (a host that drops packets would hold a bare
# connect for minutes); stop when the head's step (head_pid) has ended, or on SIGTERM
# (stop_if_terminated).
wait_for_port() {
  local host=$1 port=$2 timeout_s=$3 deadline=$((SECONDS + $3))
  while ((SECONDS < deadline)); do
    # shellcheck disable=SC2016  # $0 / $1 are the inner shell's arguments
    if timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$host" "$port" 2>/dev/null; then
      return 0
    fi
    stop_if_terminated
    if [[ -n "${head_pid:-}" ]] && ! kill -0 "$head_pid" 2>/dev/null; then
      echo "train_grpo.sh: the Ray head's step ended before its port $host:$port opened (see its output above)" >&2
      exit 1
    fi
    sleep 0.2
  done
  echo "train_grpo.sh: the Ray head's port $host:$port did not open within $timeout_s s (MLRL_RAY_WAIT_S)" >&2
  exit 1
}

stop_if_terminated() {
  if [[ -n "$terminated" ]]; then
    echo "train_grpo.sh: SIGTERM before the launcher started: stopping" >&2
    exit 143
  fi
}

mapfile -t nodes < <(scontrol show hostnames "$nodelist")
if ((${#nodes[@]} != nnodes)); then
  echo "train_grpo.sh: scontrol listed ${#nodes[@]} hosts for SLURM_NNODES=$nnodes" >&2
  exit 1
fi
head=${nodes[0]}
step=(srun --nodes=1 --ntasks=1 --overlap)

# The launcher step, in the background so that SIGTERM is handled at once (bash runs a trap only
# between commands); its exit code is the job's (143 after SIGTERM).
launch() {
  stop_if_terminated
  local cmd=("${step[@]}" --job-name=mlrl-launch -w "$head" "${container[@]}" "$python" -m mlrl.launch "$@")
  if [[ -n "$dry" ]]; then
    run "${cmd[@]}"
    return
  fi
  local pid rc=0 i
  setsid "${cmd[@]}" &   # its own session, as run_bg's steps: SIGTERM reaches it through on_term
  pid=$!
  for ((i = 0; i < 600; i++)); do   # its JOBID.STEP, for on_term (registered within a second)
    launch_step=$(steps_named mlrl-launch)
    if [[ -n "$launch_step" ]] || ! kill -0 "$pid" 2>/dev/null; then
      break
    fi
    sleep 0.2
  done
  if [[ -n "$terminated" && -n "$launch_step" ]]; then
    on_term
  fi
  while :; do   # `wait` returns early when a trapped signal arrives: wait again until it has ended
    rc=0
    wait "$pid" || rc=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  echo "train_grpo.sh: mlrl.launch exited $rc${terminated:+ (after SIGTERM)}" >&2
  return "$rc"
}

# One node: the local launcher places trainer ranks and engines on this node's GPUs (or its CPU
# path) itself; a Ray cluster would be started and never used (mlrl.launch joins one for --nodes > 1)
if ((nnodes == 1)); then
  if ((gpus_per_node == 0)); then
    echo "train_grpo.sh: 1 node without GPUs: mlrl's local CPU path (no Ray), config $config" >&2
  else
    echo "train_grpo.sh: 1 node x $gpus_per_node GPUs: mlrl's local launcher (no Ray), config $config" >&2
  fi
  launch --nodes 1 --config "$config" "cluster.gpus_per_node=$gpus_per_node" "$@"   # whatever the recipe's nodes
  exit
fi

devices=$gpus_per_node
what="GPUs"
if ((gpus_per_node == 0)); then
  if ! [[ "$slots" =~ ^[1-9][0-9]*$ ]]; then
    echo "train_grpo.sh: MLRL_CPU_SLOTS_PER_NODE='$slots' must be a whole number >= 1" >&2
    exit 1
  fi
  devices=$slots
  what="CPU device slots (no GPUs granted: every process takes the CPU path)"
fi
if ! [[ "$wait_s" =~ ^[1-9][0-9]*$ ]]; then
  echo "train_grpo.sh: MLRL_RAY_WAIT_S='$wait_s' must be a whole number of seconds >= 1" >&2
  exit 1
fi

if [[ -n "$dry" ]]; then
  head_ip=$head
else
  # the address the head's host name resolves to (the cluster network's, normally); on hosts whose
  # /etc/hosts maps the name to loopback (127.0.1.1 on Debian / Ubuntu) the workers would dial
  # their own loopback: then the head's first IPv4 address off loopback (`hostname -I`)
  head_ip=$("${step[@]}" -w "$head" hostname --ip-address | awk '{print $1}')
  if [[ $head_ip == 127.* ]]; then
    # shellcheck disable=SC2016  # an awk program: its $i is awk's
    ipv4='{for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]+[.][0-9]+[.][0-9]+[.][0-9]+$/ && $i !~ /^127[.]/) {print $i; exit}}'
    off_loopback=$("${step[@]}" -w "$head" hostname -I 2>/dev/null | awk "$ipv4") || off_loopback=""
    [[ -z $off_loopback ]] || head_ip=$off_loopback
  fi
fi
address="$head_ip:$ray_port"
echo "train_grpo.sh: $nnodes node(s) x $devices $what, Ray head $head ($address), config $config" >&2
launch_args=(--nodes "$nnodes" --config "$config" "cluster.ray_address=$address" "cluster.gpus_per_node=$devices" "$@")

# The config is validated on the head before any Ray step starts: a typo or a bad value fails in
# seconds, with the launcher's one-line error, instead of after the whole cluster has joined.
check=("${step[@]}" --job-name=mlrl-check -w "$head" "${container[@]}" "$python" -m mlrl.launch --print-config
       "${launch_args[@]}")
if [[ -n "$dry" ]]; then
  run "${check[@]}"
else
  rc=0
  "${check[@]}" > /dev/null || rc=$?
  if ((rc == 2)); then
    echo "train_grpo.sh: the launcher refused the config (its error is above); no Ray step was started" >&2
    exit 2
  elif ((rc != 0)); then
    echo "train_grpo.sh: the config check step on $head failed (exit $rc: srun, the container or Python; see" \
         "above); no Ray step was started" >&2
    exit "$rc"
  fi
fi
stop_if_terminated

# One Ray auth token for this job, in the environment every step inherits (head, workers and the
# launcher's driver): the cluster is closed to other users of the nodes, and a stale
# ~/.ray/auth_token (left by a local ray.init) cannot make the workers' join fail. Set
# RAY_AUTH_MODE yourself to choose otherwise.
if [[ -z "${RAY_AUTH_MODE:-}" ]]; then
  export RAY_AUTH_MODE=token
  RAY_AUTH_TOKEN=${RAY_AUTH_TOKEN:-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')}
  export RAY_AUTH_TOKEN
fi
# No drain on SIGTERM: Ray 2.60's nodes wait up to 30 s to drain (for Ray Serve replicas) when
# `ray start --block` gets SIGTERM. By the time stop_ray runs the launcher has ended every mlrl
# process, and the head's own GCS gets the same signal, so its drain request could only time out:
# 30 s of the allocation per job end, and of the 180 s the time limit leaves.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}
[[ -n "$dry" ]] || ray_started=1
run_bg "${step[@]}" --job-name=mlrl-ray-head -w "$head" "${container[@]}" \
  "$ray" start --head --node-ip-address="$head_ip" --port="$ray_port" --num-gpus="$devices" --block
[[ -n "$dry" ]] || head_pid=$!
run wait_for_port "$head_ip" "$ray_port" "$wait_s"
stop_if_terminated
for node in "${nodes[@]:1}"; do
  run_bg "${step[@]}" --job-name=mlrl-ray-worker -w "$node" "${container[@]}" \
    "$ray" start --address="$address" --num-gpus="$devices" --block
done

run "${step[@]}" -w "$head" "${container[@]}" \
  "$python" -m mlrl.cluster wait --address "$address" --nodes "$nnodes" --gpus-per-node "$devices" --timeout "$wait_s"

launch "${launch_args[@]}"

#!/usr/bin/env bash
# GRPO on a Slurm allocation: a Ray cluster over the allocated nodes (head on the first node,
# workers on the rest, each started with srun), a wait until every node has registered with its
# GPUs, then `python -m mlrl.launch --nodes $SLURM_NNODES --config ...` on the head node.
#
#   sbatch slurm/train_grpo.sh                                   # launch/qwen3_8b_grpo.yaml
#   MLRL_CONFIG=launch/qwen3_30b_a3b_fp8.yaml sbatch slurm/train_grpo.sh trainer.lr=2e-6
#   MLRL_CONTAINER_IMAGE=/images/mlrl.sqsh sbatch slurm/train_grpo.sh   # pyxis/enroot container
#   sbatch --nodes=4 slurm/train_grpo.sh rollout.num_engines=8           # other sizes: plan first with
#                                                                        # python -m mlrl.launch --dry-run --nodes 4
# Arguments are `a.b=c` config overrides passed to mlrl.launch.
#
# Environment (all optional):
#   MLRL_CONFIG             recipe (default: launch/qwen3_8b_grpo.yaml)
#   MLRL_CONTAINER_IMAGE    run every step in this image (srun --container-image, needs pyxis)
#   MLRL_CONTAINER_MOUNTS   srun --container-mounts (default: the submit directory at the same path)
#   MLRL_PYTHON             python executable on the nodes (default: python)
#   MLRL_RAY_PORT           Ray GCS port on the head node (default: 6379)
#   MLRL_RAY_WAIT_S         seconds to wait for all nodes to register (default: 600)
#   MLRL_SLURM_DRY_RUN=1    print the srun / ray / launch commands instead of running them
#
# Job steps after the first use --overlap: the Ray steps hold the nodes for the whole job. Steps
# that request no GPUs see the job's GPUs (Slurm's default), which is what `ray start` needs.
#SBATCH --job-name=mlrl-grpo
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail

nnodes=${SLURM_NNODES:?not inside a Slurm allocation: SLURM_NNODES is unset (submit with sbatch)}
nodelist=${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is unset}
gpus_per_node=${SLURM_GPUS_ON_NODE:-8}
workdir=${SLURM_SUBMIT_DIR:-$PWD}
config=${MLRL_CONFIG:-launch/qwen3_8b_grpo.yaml}
python=${MLRL_PYTHON:-python}
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

# Same, in the background (the long-running Ray steps).
run_bg() {
  if [[ -n "$dry" ]]; then
    printf '%q ' "$@"
    printf '&\n'
  else
    "$@" &
  fi
}

cleanup() {
  local pids
  mapfile -t pids < <(jobs -p)
  if ((${#pids[@]})); then
    kill "${pids[@]}" 2>/dev/null || true
  fi
}
trap cleanup EXIT

mapfile -t nodes < <(scontrol show hostnames "$nodelist")
if ((${#nodes[@]} != nnodes)); then
  echo "train_grpo.sh: scontrol listed ${#nodes[@]} hosts for SLURM_NNODES=$nnodes" >&2
  exit 1
fi
head=${nodes[0]}

if [[ -n "$dry" ]]; then
  head_ip=$head
else
  head_ip=$(srun --nodes=1 --ntasks=1 --overlap -w "$head" hostname --ip-address | awk '{print $1}')
fi
address="$head_ip:$ray_port"
echo "train_grpo.sh: $nnodes node(s) x $gpus_per_node GPUs, Ray head $head ($address), config $config" >&2

run_bg srun --nodes=1 --ntasks=1 --overlap -w "$head" "${container[@]}" \
  ray start --head --node-ip-address="$head_ip" --port="$ray_port" --num-gpus="$gpus_per_node" --block
run sleep 10
for node in "${nodes[@]:1}"; do
  run_bg srun --nodes=1 --ntasks=1 --overlap -w "$node" "${container[@]}" \
    ray start --address="$address" --num-gpus="$gpus_per_node" --block
done

run srun --nodes=1 --ntasks=1 --overlap -w "$head" "${container[@]}" \
  "$python" -m mlrl.cluster wait --address "$address" --nodes "$nnodes" --gpus-per-node "$gpus_per_node" --timeout "$wait_s"

run srun --nodes=1 --ntasks=1 --overlap -w "$head" "${container[@]}" \
  "$python" -m mlrl.launch --nodes "$nnodes" --config "$config" "cluster.ray_address=$address" \
  "cluster.gpus_per_node=$gpus_per_node" "$@"

#!/usr/bin/env bash
# Installs Debian's slurm-wlm and munge when missing, so tests/integration/slurm runs a real
# single-host Slurm (it starts and stops its own daemons; nothing is configured system-wide).
# `make test` runs this. Needs root and apt-get; elsewhere it says why the Slurm tests will skip,
# except under CI (CI=true), where a Slurm that cannot be installed is an error, not a skip.
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1 || [[ -x "/usr/sbin/$1" ]]; }
if have sbatch && have slurmctld && have slurmd && have munged; then
  exit 0
fi
why=
if [[ $(id -u) != 0 ]]; then
  why="not root"
elif ! command -v apt-get >/dev/null; then
  why="no apt-get"
fi
if [[ -z "$why" ]]; then
  echo "setup_slurm.sh: installing slurm-wlm and munge from Debian (tests/integration/slurm)" >&2
  export DEBIAN_FRONTEND=noninteractive
  if apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null; then
    exit 0
  fi
  why="apt-get install slurm-wlm munge failed"
fi
if [[ "${CI:-}" == "true" ]]; then
  echo "setup_slurm.sh: cannot install Slurm ($why): the Slurm integration tests would only skip" >&2
  exit 1
fi
echo "setup_slurm.sh: Slurm not installed ($why): tests/integration/slurm will skip" >&2

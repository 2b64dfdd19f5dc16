#!/usr/bin/env bash
# One short GPU session on an offline GPU machine, from the repository root, once the kit's parts
# (tools/gpu_kit/prepare.py) are in KIT_DIR (default /root/g; parts and manifest.json found under
# .gpu/kit/ are copied there first). In order, each stage with its own time limit and none past
# DEADLINE_S (default 570 s) from the start:
#   1. install the kit into SITE (default /root/site); Transformer Engine's torch extension then
#      builds in the background while the vLLM-only stage runs;
#   2. the GPU rollout tests that need no trainer (CUDA IPC, sleep / wake, vLLM's routed experts);
#   3. (TE built) the end-to-end bench, tools/bench_e2e_gpu.py (BENCH_ARGS, default the Qwen3-1.7B
#      shape, 64 x 8 x 512, 1 warm-up + 1 timed step, vLLM eager);
#   4. the colocated-run test (trainer offload, CUDA IPC sync, canary, logprob gap);
#   5. the kit's own check (imports, a 10-token generation), if time is left.
# Summary lines go to stdout and $OUT/session.log; each stage's log and a tarball of
# the engine / trainer logs go to $OUT (OUT defaults to ./gpu_out). Exit 0 when every stage ran
# and passed.
set -uo pipefail
export PYTHONUNBUFFERED=1
K=${KIT_DIR:-/root/g}
S=${SITE:-/root/site}
O=${OUT:-$PWD/gpu_out}
DEADLINE_S=${DEADLINE_S:-570}
BENCH_ARGS=${BENCH_ARGS:---model-shape qwen3-1.7b --prompts 64 --group-size 8 --max-new-tokens 512 --warmup 1 --steps 1 --timeout 190 rollout.enforce_eager=true}
mkdir -p "$O" "$K"
T0=$(date +%s)
failed=0
say() { echo "[session $(($(date +%s) - T0)) s] $*" | tee -a "$O/session.log"; }
left() { echo $((DEADLINE_S - ($(date +%s) - T0))); }
cleanup() { pkill -f 'mlrl.rollout.vllm_main|vllm.entrypoints|mlrl.launch|torchrun' 2>/dev/null; sleep 2; }
stage() { # name cap_s command...: run with min(cap, time left), record the outcome
  local name=$1 cap=$2 t
  shift 2
  t=$(left)
  ((t > cap)) && t=$cap
  if ((t < 30)); then
    say "$name: skipped ($(left) s left)"
    failed=1
    return 1
  fi
  timeout -s INT -k 15 "$t" "$@" >"$O/$name.log" 2>&1
  local rc=$?
  cleanup
  ((rc == 0)) || failed=1
  say "$name: rc=$rc in ${t}s cap; $(grep -E 'passed|failed|error|ratio|kit check' "$O/$name.log" | tail -1)"
  return $rc
}
pytest_stage() { # name cap_s tests...
  local name=$1 cap=$2
  shift 2
  stage "$name" "$cap" python3 -m pytest -p no:cacheprovider -o addopts="" -v -rfEs "$@"
}

cp -n .gpu/kit/kit.part* .gpu/kit/manifest.json "$K"/ 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$O/session.log"
stage install 150 bash tools/gpu_kit/device_install.sh "$K" "$S" install || {
  tail -20 "$O/install.log"
  exit 1
}
MAX_JOBS=${MAX_JOBS:-12} bash tools/gpu_kit/device_install.sh "$K" "$S" build-te >/root/te_build.log 2>&1 &
te=$!
export PYTHONPATH=$PWD:$S
pytest_stage rollout_tests 220 tests/gpu/test_weight_sync_gpu.py \
  "tests/gpu/test_colocate_gpu.py::test_sleep_releases_weights_and_kv_cache_and_wakes_to_the_same_model" \
  "tests/gpu/test_router_replay_gpu.py::test_vllm_returns_the_routes_hf_would_take"
wait $te
te_rc=$?
say "te build: rc=$te_rc; $(tail -1 /root/te_build.log)"
if ((te_rc == 0)); then
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
  stage bench 200 python3 tools/bench_e2e_gpu.py --run-dir /root/bench_run $BENCH_ARGS
  pytest_stage colocated_run 150 \
    "tests/gpu/test_colocate_gpu.py::test_trainer_offload_releases_device_memory_and_a_colocated_run_syncs_by_ipc"
else
  failed=1
fi
stage check 90 python3 tools/gpu_kit/check_install.py
tail -25 "$O/bench.log" 2>/dev/null
tar czf "$O/logs.tar.gz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.distcp' --exclude='*.bin' \
  /tmp/pytest-of-* /root/bench_run /root/tebuild/build.log /root/te_build.log 2>/dev/null
say "done: $( ((failed == 0)) && echo 'every stage passed' || echo 'some stage failed or was skipped')"
exit $failed

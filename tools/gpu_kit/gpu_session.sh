#!/usr/bin/env bash
# One short GPU session on an offline GPU machine, from the repository root, once the kit's parts
# (tools/gpu_kit/prepare.py) are in KIT_DIR (default /root/g; parts and manifest.json found under
# .gpu/kit/ are copied there first). Install first: the kit into SITE (default /root/site), then
# Transformer Engine's torch extension builds in the background while the vLLM-only stage runs.
# A warm machine that already holds this kit's install (same manifest) and the built extension
# skips both. Then the stages named in STAGES (default: all, in this order), each with its own
# time limit and none past DEADLINE_S (default 570 s) from the start:
#   rollout_tests  the GPU rollout tests that need no trainer (CUDA IPC, sleep / wake, vLLM's
#                  routed experts)                                                   (issue #31)
#   trainer_tests  tests/gpu/trainer + test_cuda_visible, 3 at a time, then the offload test
#                  alone; per-test timeouts, each result named (-v, junit XML in $OUT) (issue #30)
#   train_bench    tools/bench_train_step.py, Qwen3-1.7B shape, 16 x 2048 in 4 micro-batches:
#                  MFU, forward-only / train, memory vs HF, and FP8 (TRAIN_FP8, default
#                  tensorwise; none: no FP8 side) vs bf16 on the same batch         (issue #30)
#   auto_bench     the same shape with --micro-batch-tokens auto --mlrl-only: what the planner
#                  picks for this GPU, its estimate vs the measured peak             (issue #30)
#   e2e_bench      tools/bench_e2e_gpu.py (BENCH_ARGS, default the Qwen3-1.7B shape, 64 x 8 x 512,
#                  1 warm-up + 1 timed step, vLLM eager)                             (issue #31)
#   colocated_run  the colocated-run test (trainer offload, CUDA IPC sync, canary, logprob gap)
#   check          the kit's own check (imports, a 10-token generation)
# e.g. STAGES="trainer_tests train_bench auto_bench" for the trainer alone. Every stage but
# rollout_tests and check waits for the TE build, which runs only when such a stage is named.
# Summary lines go to stdout and $OUT/session.log (a failed stage's log tail to stdout too). Each
# stage's log, junit XML and bench JSON go to GPU_WORK (default a fresh /tmp folder), packed into
# $OUT/results.tar.gz after every stage: the device tool brings back at most 8 files, and a call
# cut at its limit still returns what the stages before wrote. The engine / trainer logs go to
# $OUT/logs.tar.gz at the end (OUT defaults to ./gpu_out). Exit 0 when every named stage ran and
# passed; 2 on an unknown stage.
set -uo pipefail
export PYTHONUNBUFFERED=1
here=$(cd "$(dirname "$0")" && pwd)
K=${KIT_DIR:-/root/g}
S=${SITE:-/root/site}
O=${OUT:-$PWD/gpu_out}
DEADLINE_S=${DEADLINE_S:-570}
BENCH_ARGS=${BENCH_ARGS:---model-shape qwen3-1.7b --prompts 64 --group-size 8 --max-new-tokens 512 --warmup 1 --steps 1 --timeout 190 rollout.enforce_eager=true}
TRAIN_FP8=${TRAIN_FP8:-tensorwise}
ALL_STAGES="rollout_tests trainer_tests train_bench auto_bench e2e_bench colocated_run check"
STAGES=${STAGES:-$ALL_STAGES}
for s in $STAGES; do
  [[ " $ALL_STAGES " == *" $s "* ]] || {
    echo "gpu_session: unknown stage '$s' in STAGES; expected some of: $ALL_STAGES" >&2
    exit 2
  }
done
mkdir -p "$O" "$K"
W=${GPU_WORK:-$(mktemp -d /tmp/gpu_session.XXXXXX)}
mkdir -p "$W"
T0=$(date +%s)
failed=0
say() { echo "[session $(($(date +%s) - T0)) s] $*" | tee -a "$O/session.log"; }
left() { echo $((DEADLINE_S - ($(date +%s) - T0))); }
# what a stage may leave behind after its timeout: engines, launchers, torchrun agents and their ranks
cleanup() {
  pkill -f 'mlrl.rollout.vllm_main|vllm.entrypoints|mlrl.launch|torchrun|torch.distributed.run|bench_train_step|mlrl.trainer.rank' \
    2>/dev/null
  sleep "${CLEANUP_WAIT_S:-2}"  # (the unit tests, whose stages are stand-ins, set 0)
}
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
  timeout -s INT -k 15 "$t" "$@" >"$W/$name.log" 2>&1
  local rc=$?
  cleanup
  ((rc == 0)) || failed=1
  say "$name: rc=$rc in ${t}s cap; $(grep -E 'passed|failed|error|ratio|kit check|Timeout' "$W/$name.log" | tail -1)"
  ((rc == 0)) || tail -n 20 "$W/$name.log"
  pack
  return $rc
}
pack() { # every stage's log, XML and JSON so far, as one file in $OUT (renamed into place: a call cut
  # during tar keeps the previous archive whole)
  tar czf "$O/.results.tar.gz" -C "$W" . 2>/dev/null && mv -f "$O/.results.tar.gz" "$O/results.tar.gz" 2>/dev/null
}
pytest_stage() { # name cap_s tests...
  local name=$1 cap=$2
  shift 2
  stage "$name" "$cap" python3 -m pytest -p no:cacheprovider -o addopts="" -v -rfEs "$@"
}

want() { [[ " $STAGES " == *" $1 "* ]]; }

# parts carried into the checkout win; te_torch.*: a Transformer Engine extension an earlier session
# built and returned (te_prebuilt.py), used instead of building when it matches this machine
cp .gpu/kit/kit.part* .gpu/kit/manifest.json .gpu/kit/te_torch.so .gpu/kit/te_torch.json "$K"/ 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$O/session.log"
stamp="$S/.mlrl_kit_manifest.json"
if cmp -s "$K/manifest.json" "$stamp" 2>/dev/null; then
  say "install: this kit is already in $S (warm machine)"
else
  stage install 150 bash "$here/device_install.sh" "$K" "$S" install || exit 1
  rm -f "$S"/transformer_engine/wheel_lib/transformer_engine_torch*.so
  cp "$K/manifest.json" "$stamp"
fi
needs_te=
for s in trainer_tests train_bench auto_bench e2e_bench colocated_run; do
  want $s && needs_te=1
done
te_so_glob="$S/transformer_engine/wheel_lib/transformer_engine_torch*.so"
if [[ -n $needs_te && -f $K/te_torch.so ]] && ! compgen -G "$te_so_glob" >/dev/null; then
  python3 "$here/te_prebuilt.py" use "$K" "$S" >"$W/te_prebuilt.log" 2>&1
  say "$(tail -1 "$W/te_prebuilt.log")"
  if compgen -G "$te_so_glob" >/dev/null \
    && ! PYTHONPATH=$S python3 -c "import transformer_engine.pytorch" >>"$W/te_prebuilt.log" 2>&1; then
    rm -f "$S"/transformer_engine/wheel_lib/transformer_engine_torch*.so
    say "te prebuilt: import transformer_engine.pytorch failed: removed, building ($W/te_prebuilt.log)"
  fi
fi
built_now=
jobs=16
want rollout_tests && jobs=12  # leave cores to the stage that runs beside the build
if [[ -z $needs_te ]]; then
  echo "not needed by STAGES" >"$W/te_build.log"
  true &
elif compgen -G "$te_so_glob" >/dev/null; then
  echo "built before" >"$W/te_build.log"
  true &
else
  built_now=1
  # its own session (setsid -w: waited for, whether it forks or not), its group id written down:
  # stopped whole (ninja, nvcc) if it outlives the deadline
  # shellcheck disable=SC2016  # $$ and $@ are the inner shell's
  MAX_JOBS=${MAX_JOBS:-$jobs} setsid -w bash -c 'echo $$ >"$0"; exec bash "$@"' "$W/te.pgid" \
    "$here/device_install.sh" "$K" "$S" build-te >"$W/te_build.log" 2>&1 &
fi
te=$!
export PYTHONPATH=$PWD:$S
if want rollout_tests; then
  pytest_stage rollout_tests 220 tests/gpu/test_weight_sync_gpu.py \
    "tests/gpu/test_colocate_gpu.py::test_sleep_releases_weights_and_kv_cache_and_wakes_to_the_same_model" \
    "tests/gpu/test_router_replay_gpu.py::test_vllm_returns_the_routes_hf_would_take"
fi
while kill -0 "$te" 2>/dev/null && (($(left) > 30)); do
  sleep 1
done
if kill -0 "$te" 2>/dev/null; then
  kill -- -"$(cat "$W/te.pgid" 2>/dev/null || echo "$te")" 2>/dev/null || kill "$te"
  wait "$te"
  te_rc=124
  echo "stopped: the deadline came first" >>"$W/te_build.log"
else
  wait "$te"
  te_rc=$?
fi
say "te build: rc=$te_rc; $(tail -1 "$W/te_build.log")"
if ((te_rc == 0)) && [[ -n $built_now ]]; then  # returned in $OUT: keep both in .gpu/kit/ for the next session
  python3 "$here/te_prebuilt.py" save "$S" "$K" "$O" >>"$W/te_build.log" 2>&1
  say "$(tail -1 "$W/te_build.log")"
fi
pack
if ((te_rc == 0)); then
  if want trainer_tests; then
    # the offload test reads the whole device's free memory: alone, after the others (3 at a time)
    pytest_stage trainer_tests 180 -n 3 --timeout 120 --junitxml="$W/trainer_tests.xml" \
      --ignore=tests/gpu/trainer/test_offload_gpu.py tests/gpu/trainer tests/gpu/test_cuda_visible.py
    pytest_stage trainer_offload 60 --timeout 50 --junitxml="$W/trainer_offload.xml" tests/gpu/trainer/test_offload_gpu.py
  fi
  fp8=()
  [[ $TRAIN_FP8 == none ]] || fp8=(--fp8-recipe "$TRAIN_FP8")
  want train_bench && stage train_bench 150 python3 tools/bench_train_step.py --device cuda \
    --model-shape qwen3-1.7b "${fp8[@]}" --json "$W/train_bench.json" --timeout 140
  want auto_bench && stage auto_bench 100 python3 tools/bench_train_step.py --device cuda \
    --model-shape qwen3-1.7b --micro-batch-tokens auto --mlrl-only --json "$W/auto_bench.json" --timeout 90
  want e2e_bench && rm -rf /root/bench_run  # a warm machine's earlier run: the bench wants an empty folder
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
  want e2e_bench && stage e2e_bench 200 python3 tools/bench_e2e_gpu.py --run-dir /root/bench_run $BENCH_ARGS
  if want colocated_run; then
    pytest_stage colocated_run 150 \
      "tests/gpu/test_colocate_gpu.py::test_trainer_offload_releases_device_memory_and_a_colocated_run_syncs_by_ipc"
  fi
else
  for s in trainer_tests train_bench auto_bench e2e_bench colocated_run; do
    want $s && say "$s: skipped (no Transformer Engine)"
  done
  [[ -z $needs_te ]] || failed=1
fi
want check && stage check 90 python3 "$here/check_install.py"
tail -25 "$W/e2e_bench.log" 2>/dev/null
tar czf "$O/logs.tar.gz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.distcp' --exclude='*.bin' \
  /tmp/pytest-of-* /root/bench_run /root/tebuild/build.log 2>/dev/null
say "done: $( ((failed == 0)) && echo 'every stage passed' || echo 'some stage failed or was skipped')"
exit $failed

#!/usr/bin/env bash
# On the offline GPU machine (Python 3.12, torch 2.11 cu130): install the kit that
# tools/gpu_kit/prepare.py built. Run from the repository root.
#
#   bash tools/gpu_kit/device_install.sh KIT_DIR [SITE]          # all steps, in order
#   bash tools/gpu_kit/device_install.sh KIT_DIR SITE install    # verify + unpack + pip install
#   bash tools/gpu_kit/device_install.sh KIT_DIR SITE build-te   # Transformer Engine's torch extension
#   bash tools/gpu_kit/device_install.sh KIT_DIR SITE check      # import vllm / TE, a 10-token generation
#
# KIT_DIR holds kit.partNN and manifest.json; SITE (default /root/site) is the install target:
# export PYTHONPATH=$PWD:SITE afterwards. The TE build compiles against the machine's torch
# (~2 min on 16 cores; MAX_JOBS overrides the parallelism) and can run beside other work.
set -uo pipefail
K=${1:?usage: device_install.sh KIT_DIR [SITE] [install|build-te|check]}
S=${2:-/root/site}
step=${3:-all}
here=$(cd "$(dirname "$0")" && pwd)
W=${KIT_WORK:-/root/kit_work}
T0=$(date +%s)
say() { echo "[kit $(( $(date +%s) - T0 )) s] $*"; }

install() {
  python3 "$here/prepare.py" --verify "$K" || return 1
  rm -rf "$W" && mkdir -p "$W" "$S" || return 1
  cat "$K"/kit.part* | tar x -C "$W" || { echo "kit: unpacking failed"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$S" "$W"/*.whl \
    || { echo "kit: pip install into $S failed"; return 1; }
  local wheels=("$W"/*.whl)
  say "installed ${#wheels[@]} wheels into $S"
}

build_te() {
  local B=/root/tebuild sdist cudnn so
  sdist=$(compgen -G "$W/transformer_engine_torch-*.tar.gz" | head -1)
  [[ -n $sdist ]] || { echo "kit: no transformer_engine_torch sdist in $W (run the install step first)"; return 1; }
  cudnn=$(PYTHONPATH=$S python3 -c "import nvidia.cudnn as c; print(list(c.__path__)[0])") || return 1
  rm -rf "$B" && mkdir -p "$B" && tar xzf "$sdist" -C "$B" || return 1
  ( cd "$B"/transformer_engine_torch-* && PYTHONPATH=$S NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-90} \
      MAX_JOBS=${MAX_JOBS:-16} NVTE_FRAMEWORK=pytorch CUDNN_PATH=$cudnn CPATH=$cudnn/include LIBRARY_PATH=$cudnn/lib \
      python3 -m pip install --no-index --no-deps --no-build-isolation --no-cache-dir --target "$B/out" . > "$B/build.log" 2>&1 ) \
    || { tail -30 "$B/build.log"; echo "kit: Transformer Engine torch extension build failed ($B/build.log)"; return 1; }
  so=$(find "$B/out" -name 'transformer_engine_torch*.so' | head -1)
  # copied whole or not at all: gpu_session.sh takes a present .so for a finished build
  mkdir -p "$S/transformer_engine/wheel_lib" && cp "$so" "$S/transformer_engine/wheel_lib/.partial.so" \
    && mv "$S/transformer_engine/wheel_lib/.partial.so" "$S/transformer_engine/wheel_lib/$(basename "$so")" || return 1
  say "built $(basename "$so")"
}

check() {
  PYTHONPATH=$S:${PYTHONPATH:-} python3 "$here/check_install.py"
}

case $step in
  install) install ;;
  build-te) build_te ;;
  check) check ;;
  all) install && build_te && check ;;
  *) echo "unknown step '$step': expected install, build-te or check"; exit 2 ;;
esac

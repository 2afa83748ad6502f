#!/usr/bin/env bash
# Packs what ops/bench/gpu.py needs on a GPU machine that has PyTorch but neither the
# default model nor the `gguf` package, and that takes at most 64 MiB of files per call:
# the model (98 MB) goes in two parts, over two calls back to back.
#
#   bash ops/bench/gpu_kit.sh                 # here: writes .gpukit/a and .gpukit/b
#   (device) carry .gpukit/a:  bash ops/bench/gpu_device.sh take-a
#   (device) carry .gpukit/b, at once after:  bash ops/bench/gpu_device.sh run
#
# The first call copies part a to /tmp on the device; the second joins it with part b,
# checks the sum, installs the gguf wheel beside the model and runs gpu.py into $OUT. A
# warm device machine keeps /tmp between calls only while it is held (tens of seconds
# idle): make the second call right after the first.
set -euo pipefail
cd "$(dirname "$0")/../.."
kit=${GPUKIT:-.gpukit} # another folder for a test
model=$(python -c "from worker.model.gguf import default_model_path; print(default_model_path())")
rm -rf "$kit" && mkdir -p "$kit/a" "$kit/b"
# part a: the first 56 MiB; part b: the rest (the tracked tree travels with each, ~4 MB)
split --bytes=56M --numeric-suffixes=1 --suffix-length=1 "$model" "$kit/part"
[ ! -e "$kit/part3" ] || { echo "$model is over 112 MiB: two parts do not hold it" >&2; exit 1; }
mv "$kit/part1" "$kit/a/model.part1"
mv "$kit/part2" "$kit/b/model.part2"
(cd "$(dirname "$model")" && sha256sum "$(basename "$model")") > "$kit/b/model.sha256"
version=$(python -c "import importlib.metadata as m; print(m.version('gguf'))")
python -m pip download -q --no-deps --only-binary=:all: -d "$kit/b" "gguf==$version"
du -sh "$kit/a" "$kit/b"

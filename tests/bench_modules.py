"""The benchmark scripts of ops/bench, loaded as modules for the tests of their tables and
counts (they are scripts, not a package; each puts ops/bench on sys.path as it loads)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "ops" / "bench"


def load_bench(script: str) -> ModuleType:
    """ops/bench/<script>.py as the module kvflow_bench_<script>, registered in sys.modules
    (its dataclasses look their module up there)."""
    name = f"kvflow_bench_{script}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{script}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

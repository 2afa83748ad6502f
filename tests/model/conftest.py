"""Fixtures of the model tests."""

from __future__ import annotations

import pytest

from tests.model.builds import kernel_builds, load_build
from worker.model.native import NativeKernels


@pytest.fixture(scope="session", params=kernel_builds(variants=True))
def kernels(request: pytest.FixtureRequest) -> NativeKernels:
    """The C kernels in each build this CPU runs, and its own with the AMX tiles emulated
    or (with AMX) the decode kernel's score pass on them (tests/model/builds.py)."""
    return load_build(request.param)

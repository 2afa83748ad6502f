"""Fixtures of the model tests."""

from __future__ import annotations

import pytest

from tests.model.builds import kernel_builds, load_build
from worker.model.native import NativeKernels


@pytest.fixture(scope="session", params=kernel_builds())
def kernels(request: pytest.FixtureRequest) -> NativeKernels:
    """The C kernels in each build this CPU runs (tests/model/builds.py)."""
    return load_build(request.param)

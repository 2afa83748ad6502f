"""Shared fixtures for the whole test suite."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The bundled default model, converted to a Hugging Face directory.

    Uses the default cache ($KVFLOW_CACHE_DIR or ~/.cache/kvflow), so only the first
    run on a machine pays for the conversion (~20 s).
    """
    from worker.model.gguf import cached_conversion, default_model_path

    return cached_conversion(default_model_path())

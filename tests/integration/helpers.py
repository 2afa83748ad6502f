"""Small helpers shared by the end-to-end tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest


async def eventually(
    fetch: Callable[[], Awaitable[Any]], what: str, *, timeout: float = 30.0, every: float = 0.05
) -> Any:
    """Call `fetch` until it returns something truthy; fail after `timeout` seconds."""
    until = time.monotonic() + timeout
    while True:
        value = await fetch()
        if value:
            return value
        if time.monotonic() > until:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(every)


def stored(text: str) -> str:
    """`text` as the ledger keeps it: U+0000 (which random weights do generate) as U+FFFD."""
    return text.replace("\x00", "\ufffd")

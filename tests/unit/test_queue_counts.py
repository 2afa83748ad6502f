"""`kvflow status`'s unacknowledged count through `rabbitmqctl`, around a stand-in for
the tool: a call cancelled while the tool runs leaves no child behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest

from worker.admin.queues import _counts_rabbitmqctl


def fake_rabbitmqctl(bin_dir: Path, body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shell script named rabbitmqctl, first on PATH, running `body`."""
    tool = bin_dir / "rabbitmqctl"
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


async def test_a_cancelled_count_kills_and_reaps_rabbitmqctl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid_file = tmp_path / "pid"
    # the stand-in says it has started, then hangs as a broker that never answers would
    fake_rabbitmqctl(
        tmp_path,
        f"echo $$ > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}\nexec sleep 600",
        monkeypatch,
    )

    task = asyncio.create_task(_counts_rabbitmqctl("/", "q"))
    for _ in range(3000):  # until the tool has started (30 s at most)
        if pid_file.exists() or task.done():
            break
        await asyncio.sleep(0.01)
    assert pid_file.exists(), "the stand-in rabbitmqctl never started"
    pid = int(pid_file.read_text())
    try:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(ProcessLookupError):  # killed and reaped, not a zombie
            os.kill(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def test_counts_come_from_the_named_queue_and_a_failure_is_explained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = '[{"name":"other","messages_ready":9,"messages_unacknowledged":9},'
    rows += '{"name":"q","messages_ready":3,"messages_unacknowledged":5}]'
    fake_rabbitmqctl(tmp_path, f"echo '{rows}'", monkeypatch)
    assert await _counts_rabbitmqctl("/", "q") == (3, 5)
    with pytest.raises(LookupError, match="'missing' not found in vhost '/'"):
        await _counts_rabbitmqctl("/", "missing")

    fake_rabbitmqctl(tmp_path, "echo 'vhost not found' >&2; exit 2", monkeypatch)
    with pytest.raises(RuntimeError, match=r"failed \(2\): vhost not found"):
        await _counts_rabbitmqctl("/", "q")

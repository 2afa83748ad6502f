"""A throwaway world for the stress scripts: its own queues, ledger schema and tiny model,
on the same services (and environment variables) as the integration tests."""

from __future__ import annotations

import contextlib
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from broker.topology import Topology  # noqa: E402
from tests.integration.conftest import (  # noqa: E402
    AMQP_URL,
    POSTGRES_URL,
    _execute,
    delete_topology,
    with_search_path,
)
from tests.integration.harness import Harness  # noqa: E402
from tests.integration.stress import Tally, tiny_model  # noqa: E402
from worker.ledger.migrate import upgrade_async  # noqa: E402


def model_dir() -> Path:
    """The tests' tiny random-weight model, made once per machine."""
    out = Path(tempfile.gettempdir()) / "kvflow-stress-tiny-smollm2"
    out.mkdir(exist_ok=True)
    return tiny_model(out)


@contextlib.asynccontextmanager
async def world(name: str, log_root: Path) -> AsyncIterator[Harness]:
    tag = uuid.uuid4().hex[:12]
    topo = Topology(
        queue=f"stress.{tag}", exchange=f"stress.{tag}.x", control_exchange=f"stress.{tag}.control"
    )
    schema = f"kvflow_stress_{tag}"
    await _execute(POSTGRES_URL, f'CREATE SCHEMA "{schema}"')
    url = with_search_path(POSTGRES_URL, schema)
    log_dir = log_root / name
    log_dir.mkdir(parents=True, exist_ok=True)
    h = Harness(AMQP_URL, topo, url, log_dir)
    try:
        await upgrade_async(url)
        await h.open()
        yield h
    finally:
        with contextlib.suppress(Exception):
            await h.close()
        with contextlib.suppress(Exception):
            await delete_topology(AMQP_URL, topo)
        with contextlib.suppress(Exception):
            await _execute(POSTGRES_URL, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def table(tallies: list[Tally], commands: dict[str, str]) -> str:
    """The README's table: one row per scenario."""
    lines = [
        "| fault or input class | messages | completed | rejected (error reply or dead letter) "
        "| lost | duplicated | repeated replies | unanswered | wrongly dead-lettered | time | command |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for t in tallies:
        lines.append(
            f"| {t.name} | {t.requests} | {t.completed} | {t.rejected} | {t.lost} | "
            f"{t.duplicated} | {t.repeated} | {t.unanswered} | {t.dead_lettered} | {t.seconds:.0f} s | "
            f"`{commands.get(t.name, '')}` |"
        )
    return "\n".join(lines)

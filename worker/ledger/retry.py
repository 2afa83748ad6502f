"""How the ledger store's batches reach a database that may be away or may refuse a row.

`Retrier.run` awaits a write until it succeeds: a transient failure (the connection, not
the statement, failed) is retried after a doubling delay capped at `retry_max_s`, and an
outage is logged once when it starts and once when it ends, however many retries it
takes. `Retrier.batch` writes a batch in one statement and, when the database refuses
it (a constraint, an integer out of range), writes its items one by one, so that only
the items the database refuses fail (with `LedgerWriteError`), never their neighbours.
Both of the store's batch loops (records and delivery marks) write through it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from broker.redact import redact_url
from worker.ledger.migrate import describe_error, is_transient

log = logging.getLogger("worker.ledger.store")

T = TypeVar("T")
R = TypeVar("R")
FIRST_DELAY_S = 0.05


class LedgerWriteError(ValueError):
    """The database refused this record (a constraint or type error); retrying won't help."""


class Retrier:
    """Retries transient failures of one database's writes; counts failed attempts in
    `errors` (transient ones and refused rows alike) for the metrics."""

    def __init__(self, url: str, *, retry_max_s: float, held: Callable[[], int]) -> None:
        """`held`: how many records wait for the database, for the outage's log line."""
        self._url = url
        self._retry_max_s = retry_max_s
        self._held = held
        self._outage_since: float | None = None
        self.errors = 0

    async def run(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """`await attempt()` until it does not fail transiently; other errors are raised."""
        delay = FIRST_DELAY_S
        while True:
            try:
                result = await attempt()
            except Exception as e:
                if not is_transient(e):
                    raise
                self.failed(e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._retry_max_s)
                continue
            self.recovered()
            return result

    async def batch(
        self,
        items: Sequence[T],
        write: Callable[[Sequence[T]], Awaitable[Mapping[str, R]]],
        key: Callable[[T], str],
    ) -> tuple[dict[str, R], dict[str, LedgerWriteError]]:
        """`write(items)` in one go, else item by item if the database refuses the batch.

        Returns the merged results of the writes that went through, and an error for
        each key the database refused. Transient failures are retried (see `run`).
        """
        try:
            return dict(await self.run(lambda: write(items))), {}
        except Exception as e:
            if len(items) == 1:
                return {}, {key(items[0]): self._refused(key(items[0]), e)}
            log.warning(
                "ledger: a batch of %d rows was refused (%s); writing them one by one",
                len(items),
                describe_error(e, self._url),
            )
        results: dict[str, R] = {}
        refused: dict[str, LedgerWriteError] = {}
        for item in items:
            try:
                results.update(await self.run(functools.partial(write, [item])))
            except Exception as e:
                refused[key(item)] = self._refused(key(item), e)
        return results, refused

    def _refused(self, id: str, exc: Exception) -> LedgerWriteError:
        self.errors += 1
        reason = describe_error(exc, self._url)
        log.error("ledger: request %s refused by the database: %s", id, reason)
        return LedgerWriteError(f"ledger refused request {id}: {reason}")

    def failed(self, exc: BaseException) -> None:
        """Count a transient failure; log the outage if it just began."""
        self.errors += 1
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            log.warning(
                "ledger: database at %s unavailable (%s); holding %d records, retrying",
                redact_url(self._url),
                describe_error(exc, self._url),
                self._held(),
            )

    def recovered(self) -> None:
        """Log the end of an outage, if there was one."""
        if self._outage_since is not None:
            down_s = time.monotonic() - self._outage_since
            self._outage_since = None
            log.warning(
                "ledger: database at %s is back after %.1f s", redact_url(self._url), down_s
            )

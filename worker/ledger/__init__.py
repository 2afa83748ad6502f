"""The request ledger: one row per request and per worker in PostgreSQL (or SQLite).

- `states`: the values of the status and state columns, as enums.
- `tables`: the schema (SQLAlchemy Core); `migrations/` holds the same as Alembic scripts.
- `records`: `RequestRecord`, `WorkerRecord` and the merge rule of two states of a request.
- `statements`: the upserts that apply that rule in SQL.
- `retry`: retrying writes through an outage; a refused batch falls back row by row.
- `writer`: the batched records; `marks`: the batched delivery marks.
- `store`: `LedgerStore`, the one way to write the ledger; `threaded`: it, for sync code.
- `migrate`: database URLs, engines and migrations; `commands`: `kvflow db`.
"""

from worker.ledger.records import RequestRecord, WorkerRecord, merge, storable
from worker.ledger.retry import LedgerWriteError
from worker.ledger.states import LedgerStatus, RequestSource, WorkerState
from worker.ledger.store import LedgerStore
from worker.ledger.writer import LedgerClosed

__all__ = [
    "LedgerClosed",
    "LedgerStatus",
    "LedgerStore",
    "LedgerWriteError",
    "RequestRecord",
    "RequestSource",
    "WorkerRecord",
    "WorkerState",
    "merge",
    "storable",
]

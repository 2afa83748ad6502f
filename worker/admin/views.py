"""How the admin commands show things: aligned tables for people, JSON for scripts.

The JSON documents are the contract for scripts (timestamps as ISO 8601 UTC strings,
durations in seconds, None as null); the tables are for reading and may change.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import click

from broker.control import ControlReply

# A worker whose last heartbeat is older than this is dead (3 missed beats of the
# default 2 s would be 6 s; 15 s also covers a slow event loop or a busy database).
DEAD_AFTER_S = 15.0


def jsonable(value: Any) -> Any:
    """`json.dumps` default: datetimes as ISO strings, other odd types as text."""
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    return str(value)


def dumps(obj: Any, *, indent: int | None = 2) -> str:
    return json.dumps(obj, default=jsonable, indent=indent, ensure_ascii=False)


def emit_json(obj: Any) -> None:
    click.echo(dumps(obj))


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces; None shows as '-'."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1 else f"{v:,.1f}"
    if isinstance(v, datetime):
        return v.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    return str(v)


def ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


# -- workers --------------------------------------------------------------------------------


def worker_view(
    row: Mapping[str, Any], now: datetime, dead_after_s: float = DEAD_AFTER_S
) -> dict[str, Any]:
    """One `workers` row as shown: `status` is its state, 'dead' if it went silent."""
    beat = row.get("last_heartbeat")
    age = (now - beat).total_seconds() if isinstance(beat, datetime) else None
    state = str(row.get("state"))
    alive = state != "stopped" and age is not None and age <= dead_after_s
    status = state if state == "stopped" or alive else "dead"
    info = row.get("info") or {}
    return {
        "worker": row.get("id"),
        "status": status,
        "state": state,
        "alive": alive,
        "host": row.get("host"),
        "pid": row.get("pid"),
        "device": row.get("device"),
        "model": row.get("model"),
        "queue": row.get("queue"),
        "running": row.get("running"),
        "waiting": row.get("waiting"),
        "held": info.get("held"),
        "kv_usage": row.get("kv_usage"),
        "tokens_per_s": row.get("tokens_per_s"),
        "started_at": row.get("started_at"),
        "last_heartbeat": beat,
        "heartbeat_age_s": age,
        "pinged": False,
    }


def workers_table(views: Sequence[Mapping[str, Any]]) -> str:
    if not views:
        return "no workers in the ledger"
    headers = ["worker", "status", "host", "pid", "device", "run", "wait", "kv", "tok/s", "beat"]
    rows = [
        [
            v["worker"],
            v["status"] + ("*" if v.get("pinged") else ""),
            v["host"],
            v["pid"],
            v["device"],
            v["running"],
            v["waiting"],
            None if v["kv_usage"] is None else f"{100 * v['kv_usage']:.0f}%",
            v["tokens_per_s"],
            ago(v["heartbeat_age_s"]),
        ]
        for v in views
    ]
    note = "\n(* answered a ping just now)" if any(v.get("pinged") for v in views) else ""
    return table(headers, rows) + note


# -- status -----------------------------------------------------------------------------------


def summary_text(s: Mapping[str, Any], title: str) -> str:
    counts = s["counts"]
    active = s["active"]
    lat = s["latency_s"]
    parts = [f"{k} {v}" for k, v in counts.items() if v] or ["nothing finished"]
    lines = [
        f"{title}: " + ", ".join(parts),
        f"  now: queued {active.get('queued', 0)}, running {active.get('running', 0)}",
        f"  tokens: prompt {s['prompt_tokens']:,}, completion {s['completion_tokens']:,}; "
        f"output {s['output_tokens_per_s']:.1f} tok/s over {s['busy_s']:.1f} s busy",
    ]
    for name, label in (("ttft_s", "TTFT"), ("e2e_s", "e2e"), ("queue_s", "queue")):
        p = lat.get(name) or {}
        lines.append(f"  {label:5} p50 {_secs(p.get('p50'))}  p99 {_secs(p.get('p99'))}")
    return "\n".join(lines)


def clients_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Per client: requests, service received (and its share), median queue delay and TTFT."""
    total = sum(r["service"] for r in rows) or 1
    lines = [
        f"{'CLIENT':16} {'REQS':>6} {'SERVICE':>10} {'SHARE':>6} {'QUEUE p50':>10} {'TTFT p50':>10}"
    ]
    for r in rows:
        lines.append(
            f"{r['client'][:16]:16} {r['requests']:>6} {r['service']:>10,} "
            f"{r['service'] / total:>6.0%} {_secs(r['queue_p50_s']):>10} {_secs(r['ttft_p50_s']):>10}"
        )
    return "\n".join(lines)


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}s"


# -- control replies -------------------------------------------------------------------------


def reply_doc(r: ControlReply) -> dict[str, Any]:
    """A worker's control reply as the commands' JSON shows it."""
    return {
        "worker": r.worker,
        "cmd": r.cmd,
        "event": r.event,
        "ok": r.ok,
        "info": r.info,
        "error": r.error,
    }


def replies_table(replies: Sequence[Mapping[str, Any]]) -> str:
    headers = ["worker", "event", "ok", "state", "running", "requeued", "error"]
    rows = [
        [
            r["worker"],
            r["event"],
            "yes" if r["ok"] else "no",
            r["info"].get("state"),
            r["info"].get("running"),
            r["info"].get("requeued"),
            r.get("error"),
        ]
        for r in replies
    ]
    return table(headers, rows)


# -- one ledger row ----------------------------------------------------------------------------


def record_text(row: Mapping[str, Any]) -> str:
    width = max(len(k) for k in row)
    lines = []
    for k, v in row.items():
        shown = dumps(v, indent=None) if isinstance(v, (dict, list)) else _cell(v)
        if isinstance(v, str) and "\n" in v:
            shown = v.replace("\n", "\n" + " " * (width + 2))
        lines.append(f"{k.ljust(width)}  {shown}")
    return "\n".join(lines)

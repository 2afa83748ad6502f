"""The control plane's wire format: commands on the fanout exchange `kvflow.control`.

Every worker binds its own exclusive queue to the fanout exchange, so a command reaches
all of them; each acts only when the command's `target` is "*" or its own id. Replies go
to the command's `reply_to` (the CLI's exclusive queue) through the default exchange.

Command (msgpack map):
    {"cmd": "ping" | "drain" | "resume" | "cancel" | "scale",
     "target": "*" | "<worker id>" | "supervisor",
     "args": {...}, "id": "<command id>", "sent_at": unix seconds}
    drain:  {"timeout": seconds, "exit": bool}
    cancel: {"request_id": "..."}
    scale:  {"workers": N}  (for the local supervisor of `kvflow up`)
Reply (msgpack map):
    {"id": "<command id>", "worker": "<worker id>", "cmd": ..., "ok": bool,
     "event": "ack" | "drained" | "done", "info": {...}, "error": str | None}

Silence does not mean dead: a worker busy starting up may miss a ping's reply window.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack

COMMANDS = ("ping", "drain", "resume", "cancel", "scale")
ALL = "*"
SUPERVISOR = "supervisor"


@dataclass(frozen=True)
class ControlCommand:
    cmd: str
    target: str = ALL
    args: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    sent_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.cmd not in COMMANDS:
            raise ValueError(f"unknown control command {self.cmd!r}; one of {', '.join(COMMANDS)}")

    def addressed_to(self, worker_id: str) -> bool:
        return self.target in (ALL, worker_id)

    def encode(self) -> bytes:
        packed: bytes = msgpack.packb(
            {
                "cmd": self.cmd,
                "target": self.target,
                "args": self.args,
                "id": self.id,
                "sent_at": self.sent_at,
            },
            use_bin_type=True,
        )
        return packed

    @classmethod
    def decode(cls, body: bytes) -> ControlCommand:
        try:
            raw = msgpack.unpackb(body, raw=False)
        except Exception as e:
            raise ValueError(f"control message is not msgpack: {e}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("cmd"), str):
            raise ValueError("control message must be a map with a string 'cmd'")
        args = raw.get("args") or {}
        if not isinstance(args, dict):
            raise ValueError("control message 'args' must be a map")
        return cls(
            cmd=raw["cmd"],
            target=str(raw.get("target", ALL)),
            args=args,
            id=str(raw.get("id") or uuid.uuid4().hex),
            sent_at=float(raw.get("sent_at") or time.time()),
        )


@dataclass(frozen=True)
class ControlReply:
    id: str
    worker: str
    cmd: str
    ok: bool = True
    event: str = "ack"
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def encode(self) -> bytes:
        packed: bytes = msgpack.packb(
            {
                "id": self.id,
                "worker": self.worker,
                "cmd": self.cmd,
                "ok": self.ok,
                "event": self.event,
                "info": self.info,
                "error": self.error,
            },
            use_bin_type=True,
        )
        return packed

    @classmethod
    def decode(cls, body: bytes) -> ControlReply:
        raw = msgpack.unpackb(body, raw=False)
        if not isinstance(raw, dict):
            raise ValueError("control reply must be a map")
        return cls(
            id=str(raw.get("id", "")),
            worker=str(raw.get("worker", "")),
            cmd=str(raw.get("cmd", "")),
            ok=bool(raw.get("ok", False)),
            event=str(raw.get("event", "ack")),
            info=dict(raw.get("info") or {}),
            error=raw.get("error"),
        )

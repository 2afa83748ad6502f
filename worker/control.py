"""The worker's side of the control plane: ping, drain, resume, cancel.

Each worker listens on its own exclusive queue bound to the fanout exchange
`kvflow.control` (wire format in `broker.control`) and answers the admin CLI. The
listener knows the worker only through `Controlled`: what a worker can be told to do.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from broker.control import ControlCommand, ControlReply
from broker.publisher import ReplyPublisher

log = logging.getLogger(__name__)


class Controlled(Protocol):
    """What a worker can be told to do over the control plane."""

    @property
    def worker_id(self) -> str: ...

    @property
    def drain_timeout_s(self) -> float: ...

    def describe(self) -> dict[str, object]:
        """What `kvflow workers` shows for this worker."""

    def pause(self) -> None:
        """Stop pulling new messages (running requests go on)."""

    def resume(self) -> None:
        """Pull again."""

    async def drain(self, timeout_s: float) -> int:
        """Stop pulling, finish what runs for up to `timeout_s`, requeue the rest;
        returns how many were requeued."""

    def cancel(self, request_id: str) -> bool:
        """Cancel a request; True if it was running here."""

    def request_stop(self) -> None:
        """Begin a graceful shutdown."""


class ControlListener:
    def __init__(
        self,
        worker: Controlled,
        channel: AbstractChannel,
        publisher: ReplyPublisher,
        exchange: str,
    ) -> None:
        self.worker = worker
        self.channel = channel
        self.publisher = publisher
        self.exchange = exchange
        self._drain_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        exchange = await self.channel.get_exchange(self.exchange)
        queue = await self.channel.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind(exchange)
        await queue.consume(self._on_message, no_ack=True)

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        try:
            cmd = ControlCommand.decode(message.body)
        except ValueError as e:
            log.warning("ignored a control message: %s", e)
            return
        if not cmd.addressed_to(self.worker.worker_id):
            return
        try:
            await self._dispatch(cmd, message.reply_to)
        except Exception as e:
            log.exception("control command %s failed", cmd.cmd)
            await self._reply(message.reply_to, cmd, ok=False, error=str(e))

    async def _dispatch(self, cmd: ControlCommand, reply_to: str | None) -> None:
        worker = self.worker
        if cmd.cmd == "ping":
            await self._reply(reply_to, cmd, info=worker.describe())
        elif cmd.cmd == "resume":
            worker.resume()
            await self._reply(reply_to, cmd, info=worker.describe())
        elif cmd.cmd == "cancel":
            rid = str(cmd.args.get("request_id", ""))
            running = worker.cancel(rid)
            await self._reply(reply_to, cmd, info={"request_id": rid, "running_here": running})
        elif cmd.cmd == "drain":
            timeout = float(cmd.args.get("timeout", worker.drain_timeout_s))
            exit_after = bool(cmd.args.get("exit", False))
            worker.pause()
            await self._reply(reply_to, cmd, info=worker.describe())
            self._drain_task = asyncio.create_task(self._drain(cmd, reply_to, timeout, exit_after))
        # "scale" is for the supervisor of `kvflow up`, not for workers.

    async def _drain(
        self, cmd: ControlCommand, reply_to: str | None, timeout: float, exit_after: bool
    ) -> None:
        requeued = await self.worker.drain(timeout)
        info = {**self.worker.describe(), "requeued": requeued}
        await self._reply(reply_to, cmd, event="drained", info=info)
        if exit_after:
            self.worker.request_stop()

    async def _reply(
        self,
        reply_to: str | None,
        cmd: ControlCommand,
        *,
        ok: bool = True,
        event: str = "ack",
        info: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        if not reply_to:
            return
        reply = ControlReply(cmd.id, self.worker.worker_id, cmd.cmd, ok, event, info or {}, error)
        try:
            await self.publisher.publish(reply_to, cmd.id, reply.encode())
        except Exception as e:  # the CLI may have gone away; the command still took effect
            log.debug("control reply to %s failed: %s", reply_to, e)

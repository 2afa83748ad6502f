"""The worker's side of the control plane: ping, drain, resume, cancel.

Each worker listens on its own exclusive queue bound to the fanout exchange
`kvflow.control` (wire format in `broker.control`) and answers the admin CLI.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from broker.control import ControlCommand, ControlReply
from broker.publisher import ReplyPublisher

if TYPE_CHECKING:
    from worker.service import Service

log = logging.getLogger(__name__)


class ControlListener:
    def __init__(
        self, service: Service, channel: AbstractChannel, publisher: ReplyPublisher
    ) -> None:
        self.service = service
        self.channel = channel
        self.publisher = publisher
        self._drain_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        exchange = await self.channel.get_exchange(self.service.topology.control_exchange)
        queue = await self.channel.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind(exchange)
        await queue.consume(self._on_message, no_ack=True)

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        try:
            cmd = ControlCommand.decode(message.body)
        except ValueError as e:
            log.warning("ignored a control message: %s", e)
            return
        if not cmd.addressed_to(self.service.worker_id):
            return
        try:
            await self._dispatch(cmd, message.reply_to)
        except Exception as e:
            log.exception("control command %s failed", cmd.cmd)
            await self._reply(message.reply_to, cmd, ok=False, error=str(e))

    async def _dispatch(self, cmd: ControlCommand, reply_to: str | None) -> None:
        svc = self.service
        if cmd.cmd == "ping":
            await self._reply(reply_to, cmd, info=svc.describe())
        elif cmd.cmd == "resume":
            svc.resume()
            await self._reply(reply_to, cmd, info=svc.describe())
        elif cmd.cmd == "cancel":
            rid = str(cmd.args.get("request_id", ""))
            running = svc.cancel(rid)
            await self._reply(reply_to, cmd, info={"request_id": rid, "running_here": running})
        elif cmd.cmd == "drain":
            timeout = float(cmd.args.get("timeout", svc.config.drain_timeout_s))
            exit_after = bool(cmd.args.get("exit", False))
            svc.pause()
            await self._reply(reply_to, cmd, info=svc.describe())
            self._drain_task = asyncio.create_task(self._drain(cmd, reply_to, timeout, exit_after))
        # "scale" is for the supervisor of `kvflow up`, not for workers.

    async def _drain(
        self, cmd: ControlCommand, reply_to: str | None, timeout: float, exit_after: bool
    ) -> None:
        requeued = await self.service.drain(timeout)
        info = {**self.service.describe(), "requeued": requeued}
        await self._reply(reply_to, cmd, event="drained", info=info)
        if exit_after:
            self.service.request_stop()

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
        reply = ControlReply(cmd.id, self.service.worker_id, cmd.cmd, ok, event, info or {}, error)
        try:
            await self.publisher.publish(reply_to, cmd.id, reply.encode())
        except Exception as e:  # the CLI may have gone away; the command still took effect
            log.debug("control reply to %s failed: %s", reply_to, e)

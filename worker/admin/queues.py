"""Counting a queue's messages for `kvflow status`: ready and unacknowledged.

`ready` comes from a passive declare, which counts ready messages only (so it reads 0
while a queue's only message is unacked: the "passive declare lies" of the field notes).
`unacknowledged` has no AMQP query: it comes from `rabbitmqctl` when that is installed
and the broker runs on this machine, otherwise from the management HTTP API
(`management_url`, by default the broker's host on 15672 over HTTP, or on 15671 over
HTTPS when the broker URL is `amqps`). Both report what a quorum queue publishes on its
tick, so on 3.10 that figure can lag by about 5 s (a new message showed in rabbitmqctl
after ~5 s).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.error
import urllib.parse
import urllib.request
from base64 import b64encode
from dataclasses import dataclass

import aiormq

from broker.connection import connect
from broker.topology import amqp_url_from_env

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class ManagementApi:
    """Where the management HTTP API of a broker is, and the account to use on it."""

    base_url: str
    user: str
    password: str

    @classmethod
    def for_broker(cls, amqp_url: str, base_url: str | None = None) -> ManagementApi:
        """The API of the broker at `amqp_url` (same host and account; HTTPS for amqps),
        or at `base_url` with that account."""
        parts = urllib.parse.urlsplit(amqp_url)
        if parts.scheme not in ("amqp", "amqps"):
            raise ValueError(f"not an AMQP URL (amqp:// or amqps://): scheme {parts.scheme!r}")
        if base_url is None:
            host = parts.hostname or "localhost"
            host = f"[{host}]" if ":" in host else host
            tls = parts.scheme == "amqps"
            base_url = f"https://{host}:15671" if tls else f"http://{host}:15672"
        return cls(
            base_url.rstrip("/"),
            urllib.parse.unquote(parts.username or "guest"),
            urllib.parse.unquote(parts.password or "guest"),
        )

    def queue_url(self, vhost: str, queue: str) -> str:
        quoted = (urllib.parse.quote(x, safe="") for x in (vhost, queue))
        return f"{self.base_url}/api/queues/{'/'.join(quoted)}"

    def counts(self, vhost: str, queue: str) -> tuple[int, int]:
        """(ready, unacknowledged) of `queue`; LookupError if missing, RuntimeError if
        the API cannot be asked. Blocking: call it in a thread."""
        req = urllib.request.Request(self.queue_url(vhost, queue))
        token = b64encode(f"{self.user}:{self.password}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                data = json.load(resp)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise LookupError(f"queue {queue!r} not found in vhost {vhost!r}") from None
            raise RuntimeError(
                f"management API at {self.base_url} answered HTTP {e.code}"
            ) from None
        except urllib.error.URLError as e:
            raise RuntimeError(
                f"cannot count messages: no management API at {self.base_url} ({e.reason})"
            ) from None
        return int(data.get("messages_ready") or 0), int(data.get("messages_unacknowledged") or 0)


def vhost_of(amqp_url: str) -> str:
    """The virtual host an AMQP URL names ('/' when it names none)."""
    path = urllib.parse.urlsplit(amqp_url).path
    return urllib.parse.unquote(path[1:]) if len(path) > 1 else "/"


async def queue_counts(
    url: str | None, queue: str, *, management_url: str | None = None
) -> tuple[int, int]:
    """(ready, unacknowledged) message counts of `queue` on the broker at `url`
    ($KVFLOW_AMQP_URL); LookupError if the queue is missing, BrokerUnavailable if the
    broker is, RuntimeError if the unacknowledged count cannot be had."""
    url = amqp_url_from_env(url)
    ready = await ready_count(url, queue)
    vhost = vhost_of(url)
    local = (urllib.parse.urlsplit(url).hostname or "localhost") in LOCAL_HOSTS
    ctl_error = None
    if management_url is None and local and shutil.which("rabbitmqctl"):
        try:
            return ready, (await _counts_rabbitmqctl(vhost, queue))[1]
        except RuntimeError as e:
            ctl_error = e
    api = ManagementApi.for_broker(url, management_url)
    try:
        counts = await asyncio.to_thread(api.counts, vhost, queue)
    except RuntimeError as e:
        if ctl_error is None:
            raise
        raise RuntimeError(f"{ctl_error}; and {e}") from None
    return ready, counts[1]


async def ready_count(url: str, queue: str) -> int:
    """Ready messages of `queue`, by a passive declare."""
    connection = await connect(url, name="kvflow admin")
    try:
        channel = await connection.channel()
        try:
            declared = await channel.declare_queue(queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            raise LookupError(f"queue {queue!r} not found") from None
        return int(declared.declaration_result.message_count or 0)
    finally:
        await connection.close()


async def _counts_rabbitmqctl(vhost: str, queue: str) -> tuple[int, int]:
    args = ["-q", "list_queues", "-p", vhost, "name", "messages_ready"]
    args += ["messages_unacknowledged", "--formatter", "json"]
    proc = await asyncio.create_subprocess_exec(
        "rabbitmqctl",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await proc.communicate()
    except BaseException:
        # Cancelled (a caller's timeout, shutdown): a child left running would outlive
        # the call, its pipes open, and be found by the garbage collector much later.
        # Shielded, so that a second cancel cannot stop the reaping half way.
        if proc.returncode is None:
            proc.kill()
        await asyncio.shield(proc.communicate())
        raise
    if proc.returncode != 0:
        raise RuntimeError(
            f"rabbitmqctl list_queues failed ({proc.returncode}): {err.decode().strip()}"
        )
    for row in json.loads(out.decode() or "[]"):
        if row.get("name") == queue:
            return int(row.get("messages_ready") or 0), int(row.get("messages_unacknowledged") or 0)
    raise LookupError(f"queue {queue!r} not found in vhost {vhost!r}")

"""The broker package against a real RabbitMQ: topology, dead-lettering, replies, client, CLI.

Every test works on its own `test.<hex>` queues and exchanges (the `rabbit_topology`
fixture) and deletes them afterwards. A small fake worker stands in for the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage, AbstractQueue
from click.testing import CliRunner

from broker import BrokerUnavailable, Client, RequestFailed, SubmitFailed, SyncClient
from broker.commands import submit as submit_command
from broker.connection import connect
from broker.messages import (
    RequestMessage,
    decode_reply,
    decode_request,
    encode_delta,
    encode_error,
    encode_result,
)
from broker.publisher import ReplyPublisher, Requeuer
from broker.topology import Topology, TopologyMismatch, declare
from tests.integration.helpers import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

DELTAS = ("Hel", "lo", " world")


async def _poll(
    fetch: Callable[[], Awaitable[Any]], *, timeout: float = 20.0, every: float = 0.2
) -> Any:
    return await eventually(fetch, "a message", timeout=timeout, every=every)


async def _get_dead(queue: AbstractQueue) -> AbstractIncomingMessage:
    message = await _poll(lambda: queue.get(fail=False, no_ack=True))
    assert isinstance(message, aio_pika.IncomingMessage)
    return message


class FakeWorker:
    """Consumes the request queue like the real worker and answers from a script.

    A prompt "fail" gets an error reply; any other gets the three DELTAS when it asked
    to stream, then a result whose text is their concatenation.
    """

    def __init__(self, url: str, topo: Topology) -> None:
        self.url = url
        self.topo = topo
        self.seen: list[tuple[RequestMessage, AbstractIncomingMessage]] = []

    async def __aenter__(self) -> FakeWorker:
        self.connection = await aio_pika.connect(self.url)
        channel = await self.connection.channel()
        await channel.set_qos(prefetch_count=8)
        queue = (await declare(channel, self.topo)).queue
        self.publisher = ReplyPublisher(channel)
        await queue.consume(self._handle)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.connection.close()

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        async with message.process():
            req = decode_request(
                message.body,
                content_type=message.content_type,
                message_id=message.message_id,
                correlation_id=message.correlation_id,
                reply_to=message.reply_to,
                timestamp=message.timestamp,
                expiration=message.expiration,
                headers=message.headers,
                redelivered=bool(message.redelivered),
            )
            self.seen.append((req, message))
            if req.reply_to is None:
                return
            if req.prompt == "fail":
                body = encode_error(req.id, "prompt_too_long", "prompt is 9000 tokens")
                await self.publisher.publish(req.reply_to, req.correlation_id, body)
                return
            if req.stream:
                for i, text in enumerate(DELTAS):
                    delta = encode_delta(req.id, i, text, [i])
                    await self.publisher.publish(req.reply_to, req.correlation_id, delta)
            result = encode_result(
                req.id,
                text="".join(DELTAS),
                token_ids=[0, 1, 2],
                finish_reason="stop",
                prompt_tokens=4,
                completion_tokens=3,
                timing={"enqueued_at": req.enqueued_at, "queue_s": 0.01},
                worker="fake",
                metadata=req.metadata,
            )
            await self.publisher.publish(req.reply_to, req.correlation_id, result)


@pytest.fixture
async def fake_worker(amqp_url: str, rabbit_topology: Topology) -> AsyncIterator[FakeWorker]:
    async with FakeWorker(amqp_url, rabbit_topology) as worker:
        yield worker


@pytest.fixture
async def client(
    amqp_url: str, rabbit_topology: Topology, fake_worker: FakeWorker
) -> AsyncIterator[Client]:
    async with await Client.connect(amqp_url, topology=rabbit_topology) as c:
        yield c


# -- topology ------------------------------------------------------------------------------


async def test_declare_twice_is_idempotent(amqp_connection, rabbit_topology):
    channel = await amqp_connection.channel()
    first = await declare(channel, rabbit_topology)
    second = await declare(channel, rabbit_topology)
    assert first.queue.name == second.queue.name == rabbit_topology.queue
    assert second.dead_letter.name == f"{rabbit_topology.queue}.dead"
    await second.exchange.publish(aio_pika.Message(b"x"), routing_key=rabbit_topology.queue)
    message = await _poll(lambda: second.queue.get(fail=False, no_ack=True))
    assert message.body == b"x"


async def test_conflicting_queue_arguments_name_the_queue_and_the_argument(
    amqp_connection, rabbit_topology
):
    await declare(await amqp_connection.channel(), rabbit_topology)
    other = dataclasses.replace(rabbit_topology, delivery_limit=7)
    with pytest.raises(TopologyMismatch) as info:
        await declare(await amqp_connection.channel(), other)
    text = str(info.value)
    assert f"queue {rabbit_topology.queue!r}" in text
    assert "'x-delivery-limit' is '5' on the broker but kvflow wants '7'" in text


async def test_conflicting_exchange_type_is_named(amqp_connection, rabbit_topology):
    channel = await amqp_connection.channel()
    await channel.declare_exchange(rabbit_topology.exchange, aio_pika.ExchangeType.FANOUT)
    with pytest.raises(TopologyMismatch, match=rf"exchange '{rabbit_topology.exchange}'.*'type'"):
        await declare(await amqp_connection.channel(), rabbit_topology)


async def test_rejected_message_is_dead_lettered(amqp_connection, rabbit_topology):
    declared = await declare(await amqp_connection.channel(), rabbit_topology)
    await declared.exchange.publish(
        aio_pika.Message(b"poison", message_id="p1"), routing_key=rabbit_topology.queue
    )
    message = await _poll(lambda: declared.queue.get(fail=False))
    await message.reject(requeue=False)
    dead = await _get_dead(declared.dead_letter)
    assert dead.body == b"poison" and dead.message_id == "p1"
    assert dead.headers["x-first-death-reason"] == "rejected"
    assert dead.headers["x-first-death-queue"] == rabbit_topology.queue


async def test_message_past_the_delivery_limit_is_dead_lettered(amqp_connection, rabbit_topology):
    topo = dataclasses.replace(rabbit_topology, delivery_limit=1)
    declared = await declare(await amqp_connection.channel(), topo)
    await declared.exchange.publish(aio_pika.Message(b"crashy"), routing_key=topo.queue)
    counts = []
    for _ in range(2):  # first delivery, then one redelivery: the limit
        message = await _poll(lambda: declared.queue.get(fail=False))
        counts.append(message.headers.get("x-delivery-count"))
        await message.nack(requeue=True)
    dead = await _get_dead(declared.dead_letter)
    assert dead.body == b"crashy" and counts == [0, 1]
    assert dead.headers["x-first-death-reason"] == "delivery_limit"
    assert await declared.queue.get(fail=False) is None


# -- requeuer -----------------------------------------------------------------------------


async def test_requeuer_copies_the_message_with_its_properties_and_merged_headers(
    amqp_connection, rabbit_topology
):
    declared = await declare(await amqp_connection.channel(), rabbit_topology)
    original = aio_pika.Message(
        b"body",
        headers={"kept": "yes", "n": 1},
        content_type="application/msgpack",
        correlation_id="c9",
        reply_to="replies.x",
        message_id="m9",
        priority=3,
        app_id="svc-a",
        type="request",
        expiration=60,
    )
    await declared.exchange.publish(original, routing_key=rabbit_topology.queue)
    first = await _poll(lambda: declared.queue.get(fail=False))
    await first.nack(requeue=True)  # the broker's own count: 1 on the next delivery
    delivered = await _poll(lambda: declared.queue.get(fail=False))
    assert delivered.headers["x-delivery-count"] == 1

    requeuer = Requeuer(await amqp_connection.channel(), rabbit_topology.queue)
    await requeuer.republish(delivered, {"n": 2, "added": "z"})
    await delivered.ack()
    copy = await _poll(lambda: declared.queue.get(fail=False, no_ack=True))
    assert copy.body == b"body"
    # A new message: the broker counts its deliveries from zero again.
    assert copy.headers == {"kept": "yes", "n": 2, "added": "z", "x-delivery-count": 0}
    assert (copy.correlation_id, copy.reply_to, copy.message_id) == ("c9", "replies.x", "m9")
    assert (copy.priority, copy.app_id, copy.type) == (3, "svc-a", "request")
    assert copy.content_type == "application/msgpack"
    assert copy.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert copy.expiration is not None and copy.expiration > 0
    assert await declared.queue.get(fail=False) is None  # one copy, the original acked


# -- reply publisher -----------------------------------------------------------------------


async def test_reply_publisher_confirms_and_survives_a_missing_queue(amqp_connection, caplog):
    channel = await amqp_connection.channel()
    publisher = ReplyPublisher(channel)
    queue = await channel.declare_queue("", exclusive=True, auto_delete=True)
    assert await publisher.publish(queue.name, "c1", encode_error("r", "internal", "boom"))
    message = await _poll(lambda: queue.get(fail=False, no_ack=True))
    assert message.correlation_id == "c1" and message.content_type == "application/msgpack"
    assert decode_reply(message.body)["error"]["code"] == "internal"
    assert not await publisher.publish("test.no-such-reply-queue", "c2", b"\x80")
    assert "unroutable" in caplog.text
    assert await publisher.publish(queue.name, "c3", b"\x80")  # the channel still works


async def test_publishes_during_a_reconnect_wait_for_their_channel(
    amqp_url, amqp_connection, rabbit_topology, tcp_proxy
):
    """A robust connection comes back before its channels, and a consumer restored first
    delivers while the publishing channel is still closed: a reply or a requeue published
    then waits for that channel (bounded) instead of failing, which would send the
    delivery back to its queue in a loop, a delivery count per turn."""
    declared = await declare(await amqp_connection.channel(), rabbit_topology)
    replies = await (await amqp_connection.channel()).declare_queue("", exclusive=True)
    proxy = await tcp_proxy("127.0.0.1", 5672)
    via_proxy = amqp_url.replace(":5672", f":{proxy.port}")
    assert via_proxy != amqp_url
    connection = await connect(f"{via_proxy}?reconnect_interval=0.2", robust=True)
    try:
        channel = await connection.channel(publisher_confirms=True)
        replier = ReplyPublisher(channel)
        requeuer = Requeuer(channel, rabbit_topology.queue)
        await declared.exchange.publish(aio_pika.Message(b"req"), routing_key=declared.queue.name)
        request = await _poll(lambda: declared.queue.get(fail=False))
        assert await replier.publish(replies.name, "before", b"\x80")

        await proxy.down()  # the connection and its channels are cut, and stay cut

        async def cut() -> bool:
            return channel.is_closed

        await eventually(cut, "the client to see its channel closed")
        sending = asyncio.gather(
            replier.publish(replies.name, "during", b"\x81"), requeuer.republish(request, {})
        )
        await proxy.up()  # the connection comes back, then its channels one by one
        sent = await asyncio.wait_for(sending, 60)
        assert sent[0] is True and not channel.is_closed
        got = [await _poll(lambda: replies.get(fail=False, no_ack=True)) for _ in range(2)]
        assert [m.correlation_id for m in got] == ["before", "during"]
        await request.ack()
        copy = await _poll(lambda: declared.queue.get(fail=False, no_ack=True))
        assert copy.body == b"req"
    finally:
        await connection.close()


async def test_reply_publisher_needs_confirms(amqp_connection):
    channel = await amqp_connection.channel(publisher_confirms=False)
    with pytest.raises(ValueError, match="publisher_confirms"):
        ReplyPublisher(channel)


# -- client --------------------------------------------------------------------------------


async def test_result_and_request_properties(client, fake_worker):
    before = time.time()
    handle = await client.submit("Hi", max_tokens=8, temperature=0.0, metadata={"k": "v"})
    result = await handle.result(timeout=20)
    assert result["type"] == "result" and result["text"] == "Hello world"
    assert result["id"] == handle.id and result["metadata"] == {"k": "v"}
    req, message = fake_worker.seen[0]
    assert req.sampling == {"max_tokens": 8, "temperature": 0.0}
    assert message.message_id == handle.id and message.correlation_id == handle.id
    assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert message.reply_to == client.reply_queue
    # x-enqueued-at keeps sub-second precision, unlike the AMQP timestamp.
    assert req.enqueued_at is not None and before <= req.enqueued_at <= time.time()
    assert result["timing"]["enqueued_at"] == req.enqueued_at


async def test_stream_yields_deltas_in_order_then_final(client):
    handle = await client.submit(prompt_token_ids=[1, 2], id="s-1", stream=True)
    deltas = [d async for d in handle.stream(timeout=20)]
    assert [d["text"] for d in deltas] == list(DELTAS)
    assert [d["index"] for d in deltas] == [0, 1, 2]
    assert handle.final is not None and handle.final["text"] == "Hello world"
    assert (await handle.result()) is handle.final


async def test_error_reply_raises_request_failed(client):
    handle = await client.submit("fail")
    with pytest.raises(RequestFailed) as info:
        await handle.result(timeout=20)
    assert (info.value.code, info.value.message) == ("prompt_too_long", "prompt is 9000 tokens")
    handle = await client.submit("fail", stream=True)
    with pytest.raises(RequestFailed):
        async for _ in handle.stream(timeout=20):
            pass


async def test_many_concurrent_requests_are_matched_by_id(client):
    handles = [await client.submit(f"p{i}", id=f"many-{i}", stream=i % 2 == 0) for i in range(20)]
    results = await asyncio.gather(*(h.result(timeout=20) for h in handles))
    assert [r["id"] for r in results] == [f"many-{i}" for i in range(20)]


async def test_submit_without_reply(client, fake_worker):
    handle = await client.submit("Hi", wait_reply=False)
    await _poll(lambda: asyncio.sleep(0, result=len(fake_worker.seen)))
    assert fake_worker.seen[0][0].reply_to is None
    with pytest.raises(RuntimeError, match="wait_reply=False"):
        await handle.result()


async def test_submit_checks_arguments(client):
    with pytest.raises(TypeError, match="tempreature"):
        await client.submit("Hi", tempreature=0.5)
    with pytest.raises(ValueError, match="exactly one of"):
        await client.submit("Hi", prompt_token_ids=[1])


async def test_result_timeout(amqp_url, rabbit_topology):
    async with await Client.connect(amqp_url, topology=rabbit_topology) as c:
        handle = await c.submit("nobody is listening")
        with pytest.raises(TimeoutError, match=handle.id):
            await handle.result(timeout=0.3)


async def test_unroutable_submit_fails(amqp_url, amqp_connection, rabbit_topology):
    await declare(await amqp_connection.channel(), rabbit_topology)
    unbound = dataclasses.replace(rabbit_topology, queue=f"{rabbit_topology.queue}.unbound")
    async with await Client.connect(amqp_url, topology=unbound, declare_topology=False) as c:
        with pytest.raises(SubmitFailed, match="not routed"):
            await c.submit("Hi")


async def test_lost_connection_fails_pending_handles(amqp_url, rabbit_topology, tcp_proxy):
    proxy = await tcp_proxy("127.0.0.1", 5672)
    via_proxy = amqp_url.replace(":5672", f":{proxy.port}")
    assert via_proxy != amqp_url
    c = await Client.connect(via_proxy, topology=rabbit_topology)
    handle = await c.submit("nobody is listening")
    await proxy.down()
    with pytest.raises(BrokerUnavailable, match="lost") as info:
        await handle.result(timeout=20)
    assert "guest:guest" not in str(info.value)
    await c.close()


async def test_sync_client(amqp_url, rabbit_topology, fake_worker):
    def run() -> tuple[dict[str, Any], list[str], dict[str, Any] | None]:
        with SyncClient(amqp_url, topology=rabbit_topology) as sync:
            result = sync.submit("Hi", max_tokens=4).result(timeout=20)
            handle = sync.submit("Hi", stream=True)
            texts = [d["text"] for d in handle.stream(timeout=20)]
            with pytest.raises(RequestFailed, match="prompt_too_long"):
                sync.submit("fail").result(timeout=20)
            return result, texts, handle.final

    result, texts, final = await asyncio.to_thread(run)
    assert result["text"] == "Hello world"
    assert texts == list(DELTAS) and final is not None and final["type"] == "result"


# -- kvflow submit -------------------------------------------------------------------------


async def _invoke(args: list[str]) -> Any:
    runner = CliRunner()
    return await asyncio.to_thread(runner.invoke, submit_command, args, catch_exceptions=False)


def _cli_args(url: str, topo: Topology) -> list[str]:
    return ["--url", url, "--queue", topo.queue, "--exchange", topo.exchange]


async def test_cli_wait_prints_the_text(amqp_url, rabbit_topology, fake_worker):
    result = await _invoke(["Hi", "--max-tokens", "4", *_cli_args(amqp_url, rabbit_topology)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "Hello world"


async def test_cli_json_and_stream(amqp_url, rabbit_topology, fake_worker):
    args = ["Hi", "--json", "--id", "cli-1", *_cli_args(amqp_url, rabbit_topology)]
    result = await _invoke(args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["id"] == "cli-1"
    result = await _invoke(["Hi", "--stream", *_cli_args(amqp_url, rabbit_topology)])
    assert result.exit_code == 0, result.output
    assert result.stdout == "Hello world\n"


async def test_cli_no_wait_prints_the_id(amqp_url, rabbit_topology, fake_worker):
    args = ["--no-wait", "--id", "cli-2", "--messages-json", '[{"role": "user", "content": "Hi"}]']
    result = await _invoke([*args, *_cli_args(amqp_url, rabbit_topology)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "cli-2"
    await _poll(lambda: asyncio.sleep(0, result=len(fake_worker.seen)))
    assert fake_worker.seen[0][0].messages == [{"role": "user", "content": "Hi"}]


async def test_cli_error_reply_exits_non_zero(amqp_url, rabbit_topology, fake_worker):
    result = await _invoke(["fail", *_cli_args(amqp_url, rabbit_topology)])
    assert result.exit_code == 1
    assert "prompt_too_long" in result.output


async def test_cli_unreachable_broker_hides_the_password():
    url = "amqp://kvuser:s3cr3t-pw@127.0.0.1:1/"
    result = await _invoke(["Hi", "--url", url, "--timeout", "5"])
    assert result.exit_code != 0
    assert "cannot reach RabbitMQ at amqp://kvuser:***@127.0.0.1:1/" in result.output
    assert "s3cr3t" not in result.output


def test_cli_is_registered_on_kvflow():
    from worker.cli import main

    assert main.commands["submit"] is submit_command

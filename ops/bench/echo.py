"""The floor the queue benchmark compares kvflow with: the simplest fast echo consumer on
aio-pika. It consumes with a prefetch window, answers each request with an empty result
(publisher confirms), and acks; no engine, no ledger. Run as a process of its own so its
CPU is counted apart:

    python ops/bench/echo.py --queue bench.x [--prefetch 66]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import aio_pika
import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from broker.messages import CONTENT_TYPE, encode_result
from broker.topology import Topology, declare

TIMING = dict.fromkeys(
    ("queue_s", "ttft_s", "prefill_s", "decode_s", "e2e_s", "itl_mean_s", "itl_p50_s"), 0.0
)


async def serve(url: str, queue: str, prefetch: int) -> None:
    connection = await aio_pika.connect(url)
    channel = await connection.channel(publisher_confirms=True)
    declared = await declare(channel, Topology(queue=queue))
    await channel.set_qos(prefetch_count=prefetch)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        rid = msgpack.unpackb(message.body)["id"]
        body = encode_result(
            rid,
            text="",
            token_ids=[],
            finish_reason="length",
            prompt_tokens=1,
            completion_tokens=0,
            timing=TIMING,
            worker="echo",
        )
        if message.reply_to:
            reply = aio_pika.Message(body, content_type=CONTENT_TYPE, correlation_id=rid)
            await channel.default_exchange.publish(reply, routing_key=message.reply_to)
        await message.ack()

    await declared.queue.consume(on_message)
    print("ready", flush=True)
    await stop.wait()
    await connection.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--queue", required=True)
    ap.add_argument("--prefetch", type=int, default=66)
    ap.add_argument(
        "--amqp-url",
        default=os.environ.get("KVFLOW_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    )
    args = ap.parse_args()
    asyncio.run(serve(args.amqp_url, args.queue, args.prefetch))


if __name__ == "__main__":
    main()

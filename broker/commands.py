"""`kvflow submit`: send one request from the command line and print its reply."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import click

from broker.client import BrokerUnavailable, Client, RequestFailed, SubmitFailed
from broker.messages import InvalidRequest
from broker.redact import redact_text
from broker.topology import Topology, TopologyMismatch, amqp_url_from_env


@click.command("submit")
@click.argument("prompt", required=False)
@click.option(
    "--messages-json",
    help='Chat messages instead of PROMPT: \'[{"role": "user", "content": "Hi"}]\'.',
)
@click.option("--max-tokens", type=int, default=None)
@click.option("--temperature", type=float, default=None)
@click.option("--stream", is_flag=True, help="Print the text as it is generated.")
@click.option(
    "--wait/--no-wait", default=True, help="Wait for the result (default) or print the id."
)
@click.option("--id", "request_id", default=None, help="Request id (default: a random one).")
@click.option("--priority", type=int, default=None, help="Lower is served first.")
@click.option("--timeout", type=float, default=None, help="Seconds to wait for the result.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")
@click.option(
    "--url",
    envvar="KVFLOW_AMQP_URL",
    default=None,
    help="AMQP URL [env KVFLOW_AMQP_URL; default amqp://guest:***@localhost:5672/].",
)
@click.option("--queue", envvar="KVFLOW_QUEUE", default=None, help="[env KVFLOW_QUEUE]")
@click.option("--exchange", envvar="KVFLOW_EXCHANGE", default=None, help="[env KVFLOW_EXCHANGE]")
@click.option(
    "--no-declare",
    is_flag=True,
    help="Do not declare the exchange and queues (a producer user may not).",
)
def submit(
    prompt: str | None,
    messages_json: str | None,
    max_tokens: int | None,
    temperature: float | None,
    stream: bool,
    wait: bool,
    request_id: str | None,
    priority: int | None,
    timeout: float | None,
    as_json: bool,
    url: str | None,
    queue: str | None,
    exchange: str | None,
    no_declare: bool,
) -> None:
    """Submit PROMPT ('-' reads stdin) to the kvflow workers and print the reply."""
    if prompt == "-":
        prompt = sys.stdin.read()
    messages = _parse_messages(messages_json) if messages_json else None
    if (prompt is None) == (messages is None):
        raise click.UsageError("give either PROMPT or --messages-json (exactly one)")
    if stream and not wait:
        raise click.UsageError("--stream needs --wait")
    url = amqp_url_from_env(url)
    try:
        topo = Topology(exchange=exchange) if exchange else Topology()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    sampling = {"max_tokens": max_tokens, "temperature": temperature}
    request = {
        "prompt": prompt,
        "messages": messages,
        "id": request_id,
        "stream": stream,
        "priority": priority,
        "wait_reply": wait,
        **{k: v for k, v in sampling.items() if v is not None},
    }
    try:
        asyncio.run(_submit(url, queue, topo, request, timeout, as_json, not no_declare))
    except InvalidRequest as e:
        raise click.UsageError(f"invalid request: {e}") from None
    except (
        BrokerUnavailable,
        RequestFailed,
        SubmitFailed,
        TopologyMismatch,
        TimeoutError,
    ) as e:
        raise click.ClickException(redact_text(str(e), url)) from None


async def _submit(
    url: str,
    queue: str | None,
    topo: Topology,
    request: dict[str, Any],
    timeout: float | None,
    as_json: bool,
    declare: bool,
) -> None:
    async with await Client.connect(url, queue, topology=topo, declare_topology=declare) as client:
        handle = await client.submit(**request)
        if not request["wait_reply"]:
            click.echo(json.dumps({"id": handle.id}) if as_json else handle.id)
            return
        if request["stream"]:
            # With --json, stdout carries only the JSON: the live text goes to stderr.
            async for delta in handle.stream(timeout):
                click.echo(delta.get("text", ""), nl=False, err=as_json)
            click.echo(err=as_json)
            result = handle.final or {}
        else:
            result = await handle.result(timeout)
    if as_json:
        click.echo(json.dumps(result, ensure_ascii=False, indent=2, default=str))
    elif not request["stream"]:
        click.echo(result.get("text", ""))


def _parse_messages(text: str) -> list[dict[str, str]]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not valid JSON: {e}", param_hint="--messages-json") from None
    if not isinstance(value, list):
        raise click.BadParameter("must be a JSON list of messages", param_hint="--messages-json")
    return value

"""RabbitMQ's own permissions (ops/rabbitmq/users.sh) keep producers off the control
plane, and credentials never leak from a worker: not in its log, metrics, the admin
CLI's output, the ledger or the replies."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import socket
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import aio_pika
import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import make_url

from broker.client import Client
from broker.control import ControlCommand
from broker.topology import DEFAULT_CONTROL_EXCHANGE, Topology
from tests.integration.harness import REPO, Harness
from tests.integration.helpers import eventually
from worker.ledger.tables import requests as requests_table
from worker.ledger.tables import workers as workers_table

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Users:
    producer_url: str
    worker_url: str
    passwords: tuple[str, str]


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def users(amqp_url: str, rabbit_topology: Topology) -> Iterator[Users]:
    """A producer and a worker user for this test's queues, made by ops/rabbitmq/users.sh
    with random passwords; deleted afterwards."""
    tag = uuid.uuid4().hex[:8]
    names = (f"kvflow-test-producer-{tag}", f"kvflow-test-worker-{tag}")
    passwords = (secrets.token_urlsafe(12), secrets.token_urlsafe(12))
    own = "|".join(
        re.escape(n)
        for n in (rabbit_topology.queue, rabbit_topology.exchange, DEFAULT_CONTROL_EXCHANGE)
    )
    env = {
        **os.environ,
        "KVFLOW_PRODUCER_USER": names[0],
        "KVFLOW_PRODUCER_PASSWORD": passwords[0],
        "KVFLOW_WORKER_USER": names[1],
        "KVFLOW_WORKER_PASSWORD": passwords[1],
        "KVFLOW_EXCHANGE": rabbit_topology.exchange,
        "KVFLOW_RESOURCES": f"({own})(\\..*)?",
    }
    done = subprocess.run(
        ["bash", str(REPO / "ops/rabbitmq/users.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for pw in passwords:
        assert pw not in done.stdout + done.stderr, "the set-up script printed a password"
    host = amqp_url.split("@", 1)[1]

    def url(user: str, pw: str) -> str:
        return f"amqp://{quote(user)}:{quote(pw)}@{host}"

    try:
        yield Users(url(names[0], passwords[0]), url(names[1], passwords[1]), passwords)
    finally:
        for name in names:
            rabbitmqctl("delete_user", name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(150)
async def test_a_producer_can_submit_but_not_command_workers_and_no_password_leaks(
    users: Users, harness: Harness, tiny_dir: Path
) -> None:
    # `users` before `harness`: its users are deleted after the harness has stopped the
    # worker (deleted first, they cut its connection and it stopped without a broker).
    h = harness
    db_password = secrets.token_urlsafe(12)  # trust auth here: sent, never needed
    db_url = make_url(h.db_url).set(password=db_password).render_as_string(hide_password=False)
    port = free_port()
    w = h.start(
        "perm",
        model=tiny_dir,
        max_num_seqs=2,
        amqp_url=users.worker_url,
        database_url=db_url,
        extra=["--metrics-port", str(port), "--metrics-host", "127.0.0.1"],
    )
    await h.ready(w)

    # the producer submits and reads its reply without declaring anything
    async with await Client.connect(
        users.producer_url, topology=h.topo, declare_topology=False
    ) as producer:
        result = await (await producer.submit(prompt_token_ids=[1, 2], max_tokens=2)).result(60)
        assert result["type"] == "result"
    # it may not declare kvflow's topology
    with pytest.raises(Exception, match=r"ACCESS_REFUSED|access"):
        await Client.connect(users.producer_url, topology=h.topo, declare_topology=True)
    # nor tell workers what to do
    drain = ControlCommand("drain", target=w.id, args={"timeout": 1})
    connection = await aio_pika.connect(users.producer_url, timeout=10)
    try:
        channel = await connection.channel()
        control = await channel.get_exchange(DEFAULT_CONTROL_EXCHANGE, ensure=False)
        with pytest.raises(Exception, match="ACCESS_REFUSED"):
            await control.publish(aio_pika.Message(drain.encode()), routing_key="")
    finally:
        await connection.close()
    row = (await h.worker_rows())[w.id]
    assert row["state"] == "serving", row
    async with await Client.connect(
        users.producer_url, topology=h.topo, declare_topology=False
    ) as producer:
        again = await (await producer.submit(prompt_token_ids=[1, 3], max_tokens=2)).result(60)
    assert again["type"] == "result"

    # no password anywhere: the worker's log, its metrics, the admin CLI, the ledger,
    # the replies, and an error message about a broker it cannot reach
    leaks = [*users.passwords, db_password]
    metrics = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    )
    cli = [
        await _kvflow(
            "workers", "--json", "--amqp-url", users.worker_url, "--database-url", db_url
        ),
        await _kvflow("status", "--json", "--amqp-url", users.worker_url, "--database-url", db_url),
        await _kvflow(
            "drain",
            "nobody",
            "--amqp-url",
            f"amqp://x:{leaks[0]}@127.0.0.1:1/",
            "--database-url",
            db_url,
        ),
    ]
    async with h.db.connect() as conn:
        rows = [str(r) for r in (await conn.execute(select(requests_table))).all()]
        rows += [str(r) for r in (await conn.execute(select(workers_table))).all()]
        rows.append(str((await conn.execute(text("SELECT current_user"))).all()))
    replies = [str(r) for rs in h.client.replies.values() for r in rs]
    texts = {
        "worker log": w.output(),
        "metrics": metrics.decode(),
        "cli": "\n".join(cli),
        "ledger": "\n".join(rows),
        "replies": "\n".join(replies),
    }
    for where, content in texts.items():
        for pw in leaks:
            assert pw not in content, f"a password in the {where}"
    assert "***" in cli[2], cli[2]  # the unreachable broker's URL is shown, masked

    async def still_serving() -> bool:
        return (await h.worker_rows())[w.id]["state"] == "serving"

    await eventually(still_serving, "the worker to keep serving")


async def _kvflow(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "worker.cli",
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return out.decode() + err.decode()


def test_kubernetes_permissions_match_the_script() -> None:
    """One permission model: ops/k8s's operator resources say what users.sh sets."""
    import yaml

    printed = subprocess.run(
        ["bash", str(REPO / "ops/rabbitmq/users.sh"), "--print"],
        env={k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    script = {printed[0]: printed[1:4], printed[4]: printed[5:8]}
    docs = yaml.safe_load_all((REPO / "ops/k8s/rabbitmq-permissions/permissions.yaml").read_text())
    k8s = {
        d["spec"]["userReference"]["name"]: [
            d["spec"]["permissions"][k] for k in ("configure", "write", "read")
        ]
        for d in docs
        if d["kind"] == "Permission"
    }
    assert k8s == script

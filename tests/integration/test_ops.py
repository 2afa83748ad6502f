"""The deployment files, tried for real.

- docker-compose.yml: Debian's `docker-compose` (1.29) validates it without a Docker
  engine; its resolved form is checked for what scaling and draining need.
- ops/prometheus.yml: `promtool check config`, and its worker job drives a real
  Prometheus server (Debian's 2.42) that scrapes a real worker in the dashboard test.
- ops/grafana: provisioning and the dashboard's structure; every PromQL expression of
  the dashboard is evaluated by that Prometheus while the worker serves requests.
- ops/k8s: every manifest parses, and the fields that must agree do.
- ops/Dockerfile: what it copies exists, and its model pre-conversion snippet runs.
- README.md's `## Metrics` section and the dashboard name only series the worker exports.

Nothing skips: a missing tool fails with the command that installs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from broker.client import RequestFailed
from broker.topology import DEFAULT_QUEUE, Topology
from tests.integration.fleet import Env
from tests.integration.helpers import eventually
from worker.config import _ENV_FIELDS, _SERVICE_ENV
from worker.ledger.migrate import upgrade_async
from worker.metrics import METRIC_NAMES

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "ops" / "Dockerfile"
PROMETHEUS_CONFIG = REPO / "ops" / "prometheus.yml"
GRAFANA = REPO / "ops" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "kvflow.json"
K8S = REPO / "ops" / "k8s"
README = REPO / "README.md"

METRICS_PORT = 9400
# Requeueing what a drain left takes up to 30 s after --drain-timeout (Service.drain).
REQUEUE_S = 30

# Every KVFLOW_* variable the code reads.
KNOWN_ENV = {f"KVFLOW_{name.upper()}" for name in (*_ENV_FIELDS, *_SERVICE_ENV)} | {
    "KVFLOW_EXCHANGE",
    "KVFLOW_MIGRATIONS_DIR",
}

# Dashboard expressions allowed to come back empty here, with the reason. The test
# broker runs without RabbitMQ's prometheus plugin; these were checked by hand against
# RabbitMQ 3.10.8 with rabbitmq_prometheus (/metrics/per-object) and a Prometheus.
NO_DATA_HERE = {
    "rabbitmq_": "RabbitMQ's own exporter (rabbitmq_prometheus), not enabled on the test broker",
}


# -- helpers ------------------------------------------------------------------------------


def need(tool: str, install: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"`{tool}` is not installed: {install}", pytrace=False)
    return path


def duration_s(value: Any) -> float:
    """'120s', '2m', '1m30s', '3m' or a number (seconds) -> seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", str(value))
    assert parts and "".join(n + u for n, u in parts) == str(value), f"not a duration: {value!r}"
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name=value` or `--name value` in an argument list."""
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(args):
            return args[i + 1]
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    return [
        target["expr"]
        for panel in dashboard()["panels"]
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def concrete(expr: str, worker: str, queue: str) -> str:
    """A dashboard expression with Grafana's variables filled in."""
    for var in ("$__rate_interval", "${__rate_interval}", "$__interval", "$__range"):
        expr = expr.replace(var, "1m")
    expr = expr.replace("${worker}", worker).replace("$worker", worker)
    expr = expr.replace("${queue}", queue).replace("$queue", queue)
    assert "$" not in expr, f"a template variable is left in {expr!r}"
    return expr


def metric_names(text: str) -> set[str]:
    return set(re.findall(r"\b(kvflow_[a-z0-9_]*[a-z0-9])\b", text))


def readme_metrics_section() -> str:
    text = README.read_text()
    found = re.search(r"^## Metrics[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if found is None:
        pytest.fail("README.md has no '## Metrics' section listing the worker's metrics")
    return found[1]


def manifests() -> dict[str, list[dict[str, Any]]]:
    """ops/k8s file name -> its YAML documents."""
    docs: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        docs[path.name] = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


# -- docker-compose.yml ---------------------------------------------------------------------


def compose_config() -> dict[str, Any]:
    """docker-compose.yml as docker-compose resolves it (with the default variables)."""
    exe = need(
        "docker-compose",
        "apt-get install -y docker-compose (Debian's 1.29 validates without a Docker engine; "
        "`bash ops/setup.sh test` installs it)",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFLOW_", "COMPOSE_"))}
    cmd = [exe, "-f", str(COMPOSE)]
    check = subprocess.run(
        [*cmd, "config", "-q"], env=env, capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, f"docker-compose config -q failed:\n{check.stderr}"
    out = subprocess.run([*cmd, "config"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    config: dict[str, Any] = yaml.safe_load(out.stdout)
    return config


def test_compose_file_is_valid_and_workers_scale_and_drain() -> None:
    config = compose_config()
    services = config["services"]
    assert {"rabbitmq", "postgres", "migrate", "worker", "prometheus", "grafana"} <= set(services)

    for name in ("rabbitmq", "postgres"):
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    migrate = services["migrate"]
    assert migrate["command"] == ["db", "upgrade"]
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"

    worker = services["worker"]
    assert "container_name" not in worker, "a fixed container_name stops --scale worker=N"
    assert "ports" not in worker, "a fixed host port stops --scale worker=N"
    assert worker["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert worker["depends_on"]["rabbitmq"]["condition"] == "service_healthy"
    assert worker["image"] == migrate["image"], "migrate and worker should share the image"
    for svc in (worker, migrate):
        assert svc["build"]["dockerfile"] == "ops/Dockerfile"
        assert (Path(svc["build"]["context"]) / svc["build"]["dockerfile"]).is_file()
    command = worker["command"]
    assert command[0] == "worker"
    assert flag(command, "--metrics-port") == str(METRICS_PORT)
    drain = float(flag(command, "--drain-timeout") or 60)
    grace = duration_s(worker["stop_grace_period"])
    assert grace >= drain + REQUEUE_S, f"stop_grace_period {grace} s < drain {drain} s + requeue"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) for d in devices), devices

    for name in ("worker", "migrate"):
        env = services[name]["environment"]
        assert {"KVFLOW_AMQP_URL", "KVFLOW_DATABASE_URL"} <= set(env), name
        unknown = {k for k in env if k.startswith("KVFLOW_")} - KNOWN_ENV
        assert not unknown, f"{name}: kvflow reads no such variables: {unknown}"
    assert urlsplit(worker["environment"]["KVFLOW_AMQP_URL"]).hostname == "rabbitmq"
    assert urlsplit(worker["environment"]["KVFLOW_DATABASE_URL"]).hostname == "postgres"
    assert worker["environment"]["KVFLOW_QUEUE"] == DEFAULT_QUEUE

    # bind mounts point at files of this repository
    mounts = {}
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source, target = (
                volume.split(":")[:2]
                if isinstance(volume, str)
                else (volume["source"], volume["target"])
            )
            if source.startswith("/"):
                assert Path(source).exists(), f"{name} mounts a missing {source}"
                mounts[target] = Path(source)
    plugins = mounts["/etc/rabbitmq/enabled_plugins"].read_text()
    assert "rabbitmq_prometheus" in plugins and "rabbitmq_management" in plugins
    assert mounts["/etc/prometheus/prometheus.yml"] == PROMETHEUS_CONFIG
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "kvflow.yml").read_text())
    assert mounts[provider["providers"][0]["options"]["path"]] == DASHBOARD.parent


# -- Prometheus and Grafana files ------------------------------------------------------------


def test_prometheus_config_passes_promtool_and_finds_every_worker() -> None:
    promtool = need("promtool", "apt-get install -y prometheus (Debian's package brings promtool)")
    check = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_CONFIG)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    jobs = {
        j["job_name"]: j for j in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    }
    sd = jobs["kvflow-worker"]["dns_sd_configs"]
    # the compose service name resolves to one A record per replica
    assert any("worker" in c["names"] and c["port"] == METRICS_PORT for c in sd), sd
    rabbit = jobs["rabbitmq"]
    assert rabbit["static_configs"][0]["targets"] == ["rabbitmq:15692"]
    assert rabbit["metrics_path"] == "/metrics/per-object", "the dashboard needs queue labels"


def test_grafana_provisioning_and_dashboard_structure() -> None:
    datasource = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == datasource["uid"]
    worker = variables["worker"]
    assert worker["type"] == "query" and worker["includeAll"] and worker["allValue"] == ".*"
    assert worker["definition"] == "label_values(kvflow_worker_state, worker)"
    assert variables["queue"]["current"]["value"] == DEFAULT_QUEUE

    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all(t.get("expr") for t in panel["targets"]), panel["title"]

    exprs = dashboard_exprs()
    for expr in exprs:
        for selector in re.findall(r"\bkvflow_\w+(\{[^}]*\})?", expr):
            assert 'worker=~"$worker"' in selector, f"not filtered by $worker: {expr}"
    used = {n for e in exprs for n in metric_names(e)}
    for name in METRIC_NAMES:
        assert any(u == name or u.startswith(name + "_") for u in used), f"{name} not on the board"


# -- Kubernetes ----------------------------------------------------------------------------------


def test_k8s_manifests_parse_and_agree() -> None:
    docs = manifests()
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for file_docs in docs.values():
        for doc in file_docs:
            by_kind.setdefault(doc["kind"], []).append(doc)
    expected = {
        "Namespace", "ConfigMap", "Secret", "Job", "Deployment", "Service",
        "PodDisruptionBudget", "ScaledObject", "TriggerAuthentication", "ServiceMonitor",
        "Kustomization",
    }  # fmt: skip
    assert expected <= set(by_kind), f"missing kinds: {expected - set(by_kind)}"
    kustomization = docs["kustomization.yaml"][0]
    assert set(kustomization["resources"]) == set(docs) - {"kustomization.yaml"}

    (config,) = by_kind["ConfigMap"]
    (secret,) = by_kind["Secret"]
    (deployment,) = by_kind["Deployment"]
    (job,) = by_kind["Job"]
    (service,) = by_kind["Service"]
    (monitor,) = by_kind["ServiceMonitor"]
    (scaled,) = by_kind["ScaledObject"]
    (auth,) = by_kind["TriggerAuthentication"]
    settings = config["data"]
    secrets = secret["stringData"]

    # no credentials beyond the local defaults
    for key, url in secrets.items():
        password = urlsplit(url).password
        assert password in (None, "guest"), f"{key} holds a real-looking password"

    def check_env(container: dict[str, Any]) -> dict[str, Any]:
        env = {e["name"]: e for e in container.get("env", [])}
        for source in container.get("envFrom", []):
            assert source["configMapRef"]["name"] == config["metadata"]["name"]
        for e in env.values():
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secrets, e
        unknown = {*env, *settings} - KNOWN_ENV
        assert not unknown, f"kvflow reads no such variables: {unknown}"
        return env

    # the worker Deployment
    assert "replicas" not in deployment["spec"], "KEDA owns the replica count"
    pod = deployment["spec"]["template"]
    assert (
        deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    )
    (container,) = pod["spec"]["containers"]
    args = container["args"]
    assert args[0] == "worker" and flag(args, "--metrics-port") == str(METRICS_PORT)
    drain = float(flag(args, "--drain-timeout") or 60)
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace >= drain + REQUEUE_S, f"grace {grace} s < drain {drain} s + requeue"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/metrics" and ports.get(get["port"], get["port"]) == METRICS_PORT
    env = check_env(container)
    assert {"KVFLOW_AMQP_URL", "KVFLOW_DATABASE_URL"} <= set(env)
    assert env["KVFLOW_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"

    # the migration Job
    (migrate,) = job["spec"]["template"]["spec"]["containers"]
    assert migrate["args"] == ["db", "upgrade"]
    assert "KVFLOW_DATABASE_URL" in check_env(migrate)
    assert migrate["image"] == container["image"]

    # metrics scraping
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["clusterIP"] == "None", "headless: DNS lists every pod"
    (svc_port,) = service["spec"]["ports"]
    assert ports[svc_port["targetPort"]] == METRICS_PORT
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"][0]["port"] == svc_port["name"]

    # autoscaling on the queue
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (trigger,) = scaled["spec"]["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "rabbitmq" and meta["mode"] == "QueueLength"
    assert meta["queueName"] == DEFAULT_QUEUE == settings["KVFLOW_QUEUE"]
    per_replica = int(settings["KVFLOW_MAX_NUM_SEQS"]) + int(settings["KVFLOW_LOOKAHEAD"])
    assert int(meta["value"]) == per_replica, "value = what one replica holds at full load"
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    (host,) = [r for r in auth["spec"]["secretTargetRef"] if r["parameter"] == "host"]
    assert host["name"] == secret["metadata"]["name"]
    assert urlsplit(secrets[host["key"]]).scheme == meta["protocol"] == "http"
    assert scaled["spec"]["minReplicaCount"] in (0, 1)


# -- Dockerfile ---------------------------------------------------------------------------------


def test_dockerfile_copies_what_exists_and_its_model_snippet_runs() -> None:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    lines = [
        ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]
    ignored = {ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()}
    for line in lines:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), f"COPY of a missing {source}"
                assert source not in ignored, f".dockerignore drops {source}"
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "runs as root"
    assert any(ln.startswith("ENTRYPOINT") and '"kvflow"' in ln for ln in lines)
    assert "whl/cpu" not in text, "CPU torch in a CUDA image"

    # the build-time conversion, run here into the default cache (converted by the test
    # suite's fixtures already, so this is quick)
    snippets = re.findall(r'python -c "([^"]*cached_conversion[^"]*)"', text)
    assert len(snippets) == 1, snippets
    out = subprocess.run(
        [sys.executable, "-c", snippets[0]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    converted = Path(out.stdout.strip().split()[-1])
    assert (converted / "config.json").is_file(), out.stdout


# -- a real worker, scraped by a real Prometheus -------------------------------------------------


@pytest.fixture(scope="session")
def tiny_smollm2(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("smollm2")


@pytest.fixture
async def ops_env(
    amqp_url: str,
    rabbit_topology: Topology,
    empty_schema: Callable[[], str],
    tiny_smollm2: Path,
    tmp_path: Path,
) -> AsyncIterator[Env]:
    url = empty_schema()
    await upgrade_async(url)
    env = Env(amqp_url, rabbit_topology, url, tmp_path, tiny_smollm2)
    try:
        await env.open()
        yield env
    finally:
        await env.close()


class PrometheusServer:
    """Debian's `prometheus` binary on 127.0.0.1, storage and config in a tmp dir."""

    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = need("prometheus", "apt-get install -y prometheus (`bash ops/setup.sh test` does)")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    exe,
                    f"--config.file={self.workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)

    def tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])

    def _get(self, path: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            body = e.read()
        return json.loads(body) if path.startswith("/api/") else body

    async def ready(self, timeout: float = 30.0) -> None:
        async def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                await asyncio.to_thread(self._get, "/-/ready")
            except OSError:
                return False
            return True

        await eventually(up, "prometheus to be ready", timeout=timeout, every=0.2)

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector `expr` evaluates to now; fails the test on a query error."""
        answer = await asyncio.to_thread(
            self._get, "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        )
        assert answer.get("status") == "success", f"{expr}: {answer}"
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    async def value(self, expr: str) -> float:
        """The sum of the result's values (0 when empty)."""
        return sum(float(r["value"][1]) for r in await self.query(expr))


@contextlib.contextmanager
def prometheus_scraping(target: str, workdir: Path) -> Iterator[PrometheusServer]:
    """ops/prometheus.yml's worker job, pointed at `target` instead of Docker's DNS, at 1 s."""
    jobs = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    job = next(j for j in jobs if j["job_name"] == "kvflow-worker")
    job = {k: v for k, v in job.items() if not k.endswith("_sd_configs")}
    job["static_configs"] = [{"targets": [target]}]
    job.pop("scrape_interval", None)
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}}
    server = PrometheusServer({**config, "scrape_configs": [job]}, workdir)
    try:
        server.start()
        yield server
    finally:
        server.stop()


async def serve_some_requests(h: Env, tag: str) -> dict[str, int]:
    """Plain and streamed requests sharing a prompt prefix, one bad message (rejected
    and dead-lettered), one expired request; returns how many of each were sent."""
    prefix = list(range(100, 140))  # 40 tokens: 2 full KV blocks shared (prefix cache)
    handles = [
        await h.client.submit(
            prompt_token_ids=[*prefix, 500 + i],
            id=f"{tag}-{i}",
            max_tokens=12,
            ignore_eos=True,
            stream=i % 2 == 0,
        )
        for i in range(6)
    ]
    for handle in handles[0::2]:
        deltas = [d async for d in handle.stream(timeout=60)]
        assert deltas and handle.final is not None
    for handle in handles:
        assert (await handle.result(60))["usage"]["completion_tokens"] == 12

    bad = f"{tag}-bad"
    await h.publish_raw(b"\xc1\xc1 not msgpack", bad)
    await h.dead_letters({bad})

    late = await h.client.submit("too late", id=f"{tag}-late", deadline=time.time() - 5)
    with pytest.raises(RequestFailed) as failed:
        await late.result(30)
    assert failed.value.code == "expired"
    return {"completed": len(handles), "rejected": 1, "expired": 1}


@pytest.mark.timeout(240)
async def test_every_dashboard_query_returns_data_from_a_real_prometheus(
    ops_env: Env, tmp_path: Path
) -> None:
    h = ops_env
    port = free_port()
    w = h.worker(
        "ops", max_num_seqs=4, extra=["--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
    )
    with prometheus_scraping(f"127.0.0.1:{port}", tmp_path / "prometheus") as prom:
        await prom.ready()
        await h.ready(w)
        sel = f'{{job="kvflow-worker", worker="{w.name}"}}'

        async def scraped() -> bool:
            return await prom.value(f"kvflow_worker_state{sel}") == 1.0

        await eventually(scraped, "Prometheus's first scrape of the worker", timeout=60)

        sent = await serve_some_requests(h, f"ops-{uuid.uuid4().hex[:6]}")

        async def seen() -> bool:  # every event has reached Prometheus
            done = await prom.value(f"kvflow_request_success_total{sel}")
            rejected = await prom.value(f"kvflow_messages_rejected_total{sel}")
            held = await prom.value(f"kvflow_unacked_messages{sel}")
            return done >= sent["completed"] and rejected >= sent["rejected"] and held == 0

        await eventually(seen, "the served requests in Prometheus", timeout=30, every=0.5)
        # A few more scrapes, so that every rate has points after the events.
        scrapes = 'count_over_time(up{job="kvflow-worker"}[10m])'  # one series: the worker
        after = await prom.value(scrapes)

        async def scraped_again() -> bool:
            return await prom.value(scrapes) >= after + 3

        await eventually(scraped_again, "three more scrapes", timeout=60, every=0.5)

        reasons = {
            r["metric"]["finished_reason"]
            for r in await prom.query(f"kvflow_request_success_total{sel}")
        }
        assert "length" in reasons, reasons

        empty, not_finite, exempt = [], [], []
        for expr in dashboard_exprs():
            result = await prom.query(concrete(expr, w.name, h.topo.queue))
            reason = next((why for key, why in NO_DATA_HERE.items() if key in expr), None)
            if reason is not None:
                assert "kvflow_" not in expr, f"exempt only for RabbitMQ's metrics: {expr}"
                exempt.append(expr)
            elif not result:
                empty.append(expr)
            elif not any(math.isfinite(float(r["value"][1])) for r in result):
                not_finite.append(f"{expr} = {[r['value'][1] for r in result]}")
        assert not empty, "no data for:\n" + "\n".join(empty)
        assert not not_finite, "only NaN/Inf for:\n" + "\n".join(not_finite)
        assert exempt, "the RabbitMQ exemption is stale: drop it"
        assert w.alive(), w.tail()
    assert prom.proc is not None and prom.proc.poll() is not None, "prometheus still running"


@pytest.mark.timeout(180)
async def test_every_metric_named_in_readme_and_dashboard_is_exported(ops_env: Env) -> None:
    h = ops_env
    port = free_port()
    w = h.worker(
        "names", max_num_seqs=4, extra=["--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
    )
    await h.ready(w)
    await serve_some_requests(h, f"names-{uuid.uuid4().hex[:6]}")

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            return str(resp.read().decode())

    # The text parser returns each counter's and histogram's `_created` timestamps as a
    # family of their own: they are bookkeeping of the client library, not metrics.
    families = [
        f
        for f in text_string_to_metric_families(await asyncio.to_thread(scrape))
        if f.name.startswith("kvflow_") and not f.name.endswith("_created") and f.samples
    ]
    exported = {f.name for f in families}
    samples = {s.name for f in families for s in f.samples}

    assert exported == set(METRIC_NAMES), (
        f"listed, not exported: {sorted(set(METRIC_NAMES) - exported)}; "
        f"exported, not listed in METRIC_NAMES: {sorted(exported - set(METRIC_NAMES))}"
    )
    on_board = {n for e in dashboard_exprs() for n in metric_names(e)}
    assert on_board <= samples, f"dashboard series the worker does not export: {on_board - samples}"

    section = readme_metrics_section()
    in_readme = metric_names(section)
    assert in_readme <= exported | samples, (
        f"README names metrics the worker does not export: {in_readme - exported - samples}"
    )
    missing = set(METRIC_NAMES) - in_readme
    assert not missing, f"README's Metrics section does not mention {sorted(missing)}"

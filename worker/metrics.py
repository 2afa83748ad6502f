"""Every Prometheus metric of a worker, in one place.

Names follow vLLM's where they mean the same (`vllm:x` -> `kvflow_x`), so dashboards
for one read the other. Every series carries `worker` and `model` labels. The registry
belongs to the Metrics object (no process-global state), served by `serve()`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from broker.messages import DEFAULT_CLIENT
from worker.engine.outputs import RequestOutput, StepStats
from worker.serving.lanes import OTHER, metric_label

# Latency buckets (seconds) wide enough for CPU and GPU workers alike.
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_ITL = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_BATCH = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512)

# Every metric name (without the _total/_bucket/... suffixes Prometheus adds), for
# the README and the test that checks the dashboard's queries against the exporter.
METRIC_NAMES = (
    "kvflow_num_requests_running",
    "kvflow_num_requests_waiting",
    "kvflow_kv_cache_usage_perc",
    "kvflow_num_preemptions",
    "kvflow_prompt_tokens",
    "kvflow_generation_tokens",
    "kvflow_request_success",
    "kvflow_time_to_first_token_seconds",
    "kvflow_inter_token_latency_seconds",
    "kvflow_e2e_request_latency_seconds",
    "kvflow_request_queue_time_seconds",
    "kvflow_request_prefill_time_seconds",
    "kvflow_request_decode_time_seconds",
    "kvflow_request_prompt_tokens",
    "kvflow_request_generation_tokens",
    "kvflow_iteration_tokens",
    "kvflow_batch_size",
    "kvflow_step_time_seconds",
    "kvflow_step_overhead_seconds",
    "kvflow_prefix_cache_queries",
    "kvflow_prefix_cache_hits",
    "kvflow_messages_received",
    "kvflow_messages_redelivered",
    "kvflow_messages_acked",
    "kvflow_messages_rejected",
    "kvflow_messages_requeued",
    "kvflow_messages_replayed",
    "kvflow_messages_routed",
    "kvflow_unacked_messages",
    "kvflow_ledger_write_seconds",
    "kvflow_ledger_writes",
    "kvflow_ledger_write_errors",
    "kvflow_ledger_pending_writes",
    "kvflow_worker_state",
    "kvflow_client_service_tokens",
    "kvflow_client_requests",
    "kvflow_client_queue_time_seconds",
    "kvflow_client_time_to_first_token_seconds",
    "kvflow_client_queued_tokens",
    "kvflow_lane_credits",
)


class MessageEvent(enum.StrEnum):
    """What happened to a request message (kvflow_messages_<event>)."""

    RECEIVED = "received"
    REDELIVERED = "redelivered"
    ACKED = "acked"
    REJECTED = "rejected"  # without requeue: dead-lettered
    REQUEUED = "requeued"
    REPLAYED = "replayed"  # answered from the ledger without running
    ROUTED = "routed"  # fair mode: moved from the request queue into a client's lane


class Metrics:
    """The worker's metrics; update methods are cheap and called from the event loop."""

    def __init__(
        self,
        worker: str,
        model: str,
        registry: CollectorRegistry | None = None,
        clients: Iterable[str] = (),
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.labels = {"worker": worker, "model": model}
        self._children: dict[tuple[Any, ...], Any] = {}
        # Per-client series are labelled with the configured client names (the default
        # client too); every other client is `other`, so the label's values stay few.
        self.clients = frozenset(clients)
        r, names = self.registry, ("worker", "model")

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, (*names, *extra), registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, (*names, *extra), registry=r)

        def hist(
            name: str, doc: str, buckets: tuple[float, ...], extra: tuple[str, ...] = ()
        ) -> Histogram:
            return Histogram(name, doc, (*names, *extra), buckets=buckets, registry=r)

        lv = self.labels
        self.running = gauge(
            "kvflow_num_requests_running", "Requests in the running batch."
        ).labels(**lv)
        self.waiting = gauge(
            "kvflow_num_requests_waiting", "Requests waiting for KV blocks or a slot."
        ).labels(**lv)
        self.kv_usage = gauge(
            "kvflow_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)."
        ).labels(**lv)
        self.preemptions = counter(
            "kvflow_num_preemptions", "Requests preempted (recomputed later)."
        ).labels(**lv)
        self.prompt_tokens = counter(
            "kvflow_prompt_tokens", "Prompt tokens of finished requests."
        ).labels(**lv)
        self.generation_tokens = counter("kvflow_generation_tokens", "Generated tokens.").labels(
            **lv
        )
        self._success = counter(
            "kvflow_request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        self.ttft = hist(
            "kvflow_time_to_first_token_seconds", "Enqueue to first token.", _LATENCY
        ).labels(**lv)
        self.itl = hist(
            "kvflow_inter_token_latency_seconds", "Time between a request's tokens.", _ITL
        ).labels(**lv)
        self.e2e = hist(
            "kvflow_e2e_request_latency_seconds", "Enqueue to last token.", _LATENCY
        ).labels(**lv)
        self.queue_time = hist(
            "kvflow_request_queue_time_seconds",
            "Enqueue (broker timestamp) to first scheduled.",
            _LATENCY,
        ).labels(**lv)
        self.prefill_time = hist(
            "kvflow_request_prefill_time_seconds", "First scheduled to first token.", _LATENCY
        ).labels(**lv)
        self.decode_time = hist(
            "kvflow_request_decode_time_seconds", "First token to last token.", _LATENCY
        ).labels(**lv)
        self.req_prompt_tokens = hist(
            "kvflow_request_prompt_tokens", "Prompt length of finished requests.", _TOKENS
        ).labels(**lv)
        self.req_generation_tokens = hist(
            "kvflow_request_generation_tokens", "Output length of finished requests.", _TOKENS
        ).labels(**lv)
        self.iteration_tokens = hist(
            "kvflow_iteration_tokens",
            "Tokens computed per engine step (prefill + decode).",
            _TOKENS,
        ).labels(**lv)
        self.batch_size = hist("kvflow_batch_size", "Requests per engine step.", _BATCH).labels(
            **lv
        )
        self.step_time = hist(
            "kvflow_step_time_seconds", "Wall time of an engine step.", _ITL
        ).labels(**lv)
        self.step_overhead = hist(
            "kvflow_step_overhead_seconds", "Step time outside the forward pass.", _ITL
        ).labels(**lv)
        self.prefix_queries = counter(
            "kvflow_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(**lv)
        self.prefix_hits = counter(
            "kvflow_prefix_cache_hits", "Prompt tokens found in the prefix cache."
        ).labels(**lv)
        self._messages = {
            event: counter(f"kvflow_messages_{event}", f"Request messages {event}.").labels(**lv)
            for event in MessageEvent
        }
        self.unacked = gauge(
            "kvflow_unacked_messages", "Request messages held unacked by this worker."
        ).labels(**lv)
        self._state = Gauge(
            "kvflow_worker_state",
            "1 for the worker's current state.",
            ("worker", "model", "state"),
            registry=r,
        )
        self._client_service = counter(
            "kvflow_client_service_tokens",
            "Service received per client: tokens computed, by kind (prefill, decode).",
            ("client", "kind"),
        )
        self._client_requests = counter(
            "kvflow_client_requests",
            "Requests per client by how they ended (their ledger status).",
            ("client", "status"),
        )
        self._client_queue = hist(
            "kvflow_client_queue_time_seconds",
            "Enqueue to first scheduled, per client.",
            _LATENCY,
            ("client",),
        )
        self._client_ttft = hist(
            "kvflow_client_time_to_first_token_seconds",
            "Enqueue to first token, per client.",
            _LATENCY,
            ("client",),
        )
        self._client_queued_tokens = gauge(
            "kvflow_client_queued_tokens",
            "Prompt tokens of a client waiting in this worker (fair mode's admission control).",
            ("client",),
        )
        self._lane_credits = gauge(
            "kvflow_lane_credits",
            "Fair mode: a client lane's credits (messages it may have in this worker).",
            ("client",),
        )
        # Every label value exists from the start (at zero), so a rate over the first
        # minutes of a worker counts its first requests.
        for client in {*self.clients, DEFAULT_CLIENT, OTHER}:
            label = {**lv, "client": client}
            for kind in ("prefill", "decode"):
                self._client_service.labels(**label, kind=kind)
            self._client_queue.labels(**label)
            self._client_ttft.labels(**label)
            self._client_queued_tokens.labels(**label)
        for client in {*self.clients, OTHER}:  # the lanes (fair mode)
            self._lane_credits.labels(**lv, client=client)
        self._totals = {"preemptions": 0, "queries": 0, "hits": 0}

    # -- updates -------------------------------------------------------------------------

    def on_step(self, s: StepStats) -> None:
        for client, (prompt, generated) in s.client_tokens.items():
            label = {**self.labels, "client": self.client_label(client)}
            if prompt:
                self._client_service.labels(**label, kind="prefill").inc(prompt)
            if generated:
                self._client_service.labels(**label, kind="decode").inc(generated)
        self.running.set(s.batch_size)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_usage)
        self.generation_tokens.inc(s.num_sampled)
        if s.batch_size:
            self.iteration_tokens.observe(s.num_prefill_tokens + s.num_decode_tokens)
            self.batch_size.observe(s.batch_size)
            self.step_time.observe(s.step_time_s)
            self.step_overhead.observe(s.overhead_s)
        for key, total, metric in (
            ("preemptions", s.preemptions_total, self.preemptions),
            ("queries", s.prefix_queries_total, self.prefix_queries),
            ("hits", s.prefix_hits_total, self.prefix_hits),
        ):
            if total > self._totals[key]:
                metric.inc(total - self._totals[key])
                self._totals[key] = total

    def client_label(self, client: str | None) -> str:
        return metric_label(client or DEFAULT_CLIENT, self.clients)

    def _child(self, metric: Any, **labels: str) -> Any:
        """`metric.labels(worker, model, **labels)`, looked up once per label set (a
        label lookup costs more than the update it serves, once per request)."""
        key = (id(metric), *labels.values())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self.labels, **labels)
        return child

    def on_recorded(self, client: str | None, status: str) -> None:
        """A request's final ledger row was written."""
        self._child(self._client_requests, client=self.client_label(client), status=status).inc()

    def set_queued_tokens(self, client: str, tokens: int) -> None:
        self._client_queued_tokens.labels(**self.labels, client=self.client_label(client)).set(
            tokens
        )

    def set_lane_credits(self, client: str, credits: int) -> None:
        """Fair mode: `client`'s lane (a configured client or `other`) has `credits`."""
        self._child(self._lane_credits, client=client).set(credits)

    def on_finished(
        self, out: RequestOutput, timing: Mapping[str, Any], client: str | None = None
    ) -> None:
        """A request the engine ran has ended; `timing` is its contract timing map
        (queue delay, TTFT and end to end count from the producer's enqueue time)."""
        label = self.client_label(client)
        if timing.get("queue_s") is not None:
            self._child(self._client_queue, client=label).observe(timing["queue_s"])
        if timing.get("ttft_s") is not None:
            self._child(self._client_ttft, client=label).observe(timing["ttft_s"])
        reason = str(out.finish_reason) if out.finish_reason is not None else "error"
        self._child(self._success, finished_reason=reason).inc()
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.req_prompt_tokens.observe(out.num_prompt_tokens)
        self.req_generation_tokens.observe(len(out.token_ids))
        for name, hist in (
            ("e2e_s", self.e2e),
            ("queue_s", self.queue_time),
            ("ttft_s", self.ttft),
            ("prefill_s", self.prefill_time),
            ("decode_s", self.decode_time),
        ):
            if timing.get(name) is not None:
                hist.observe(timing[name])
        if out.timing is not None:
            for gap in out.timing.gaps_s:
                self.itl.observe(gap)

    def on_message(self, event: MessageEvent) -> None:
        self._messages[event].inc()

    def set_state(self, state: str, states: tuple[str, ...]) -> None:
        for s in states:
            self._state.labels(**self.labels, state=s).set(1.0 if s == state else 0.0)

    def watch_ledger(
        self,
        pending: Callable[[], int],
        latency: Callable[[], tuple[int, float]],
        errors: Callable[[], int],
    ) -> None:
        """Expose the ledger store's counters, read at scrape time."""
        self.registry.register(_LedgerCollector(self.labels, pending, latency, errors))

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)


class _LedgerCollector(Collector):
    def __init__(
        self,
        labels: dict[str, str],
        pending: Callable[[], int],
        latency: Callable[[], tuple[int, float]],
        errors: Callable[[], int],
    ) -> None:
        self._labels = labels
        self._pending, self._latency, self._errors = pending, latency, errors

    def collect(self) -> Iterator[Metric]:
        names, values = list(self._labels), list(self._labels.values())
        count, total = self._latency()
        g = GaugeMetricFamily(
            "kvflow_ledger_pending_writes",
            "Ledger records queued, not yet committed.",
            labels=names,
        )
        g.add_metric(values, self._pending())
        yield g
        c = CounterMetricFamily(
            "kvflow_ledger_writes", "Committed ledger write transactions.", labels=names
        )
        c.add_metric(values, count)
        yield c
        s = CounterMetricFamily(
            "kvflow_ledger_write_seconds", "Seconds spent in committed ledger writes.", labels=names
        )
        s.add_metric(values, total)
        yield s
        e = CounterMetricFamily(
            "kvflow_ledger_write_errors", "Failed ledger write attempts.", labels=names
        )
        e.add_metric(values, self._errors())
        yield e

    def describe(self) -> list[Metric]:
        return []

"""`kvflow run-batch`: an OpenAI batch JSONL file through the engine, in process.

All requests are submitted up front and flow through the continuous batch; results
are written in input order, one line per input line. A bad line becomes an error line
(status_code 400) and the batch goes on.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TextIO

from tqdm import tqdm

from worker.builder import EngineRequest, RequestBuilder
from worker.engine.engine import LLMEngine
from worker.engine.outputs import RequestOutput
from worker.ledger import RequestRecord, RequestSource
from worker.model.sampler import TokenLogprobs
from worker.openai_format import parse_body, response_body
from worker.outcome import Outcome
from worker.records import Origin, error_record, final_record, timing_of
from worker.request import InvalidInput, TimingSummary, percentile


@dataclass
class BatchItem:
    """One input line and, once done, its result."""

    line_no: int
    custom_id: str | None
    url: str = ""
    kind: str = "chat"  # "chat" | "completion"
    request: EngineRequest | None = None
    error: str | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    output: RequestOutput | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(frozen=True)
class BatchSummary:
    requests: int
    failed: int
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    wall_s: float
    ttft: list[float]
    itl: list[float]
    e2e: list[float]
    preemptions: int
    prefix_hit_rate: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def table(self) -> str:
        def q(xs: list[float], p: float) -> str:
            return f"{percentile(sorted(xs), p) * 1000:.0f}" if xs else "-"

        rows = [
            ("requests", f"{self.requests} ({self.failed} failed)"),
            ("prompt tokens", f"{self.prompt_tokens} ({self.cached_tokens} from prefix cache)"),
            ("output tokens", str(self.output_tokens)),
            ("wall time", f"{self.wall_s:.2f} s"),
            ("output tok/s", f"{self.output_tok_s:.1f}"),
            ("TTFT p50 / p99 (ms)", f"{q(self.ttft, 50)} / {q(self.ttft, 99)}"),
            ("ITL p50 / p99 (ms)", f"{q(self.itl, 50)} / {q(self.itl, 99)}"),
            ("e2e p50 / p99 (ms)", f"{q(self.e2e, 50)} / {q(self.e2e, 99)}"),
            ("preemptions", str(self.preemptions)),
            ("prefix-cache hit rate", f"{self.prefix_hit_rate:.1%}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def read_items(lines: Iterable[str], engine: LLMEngine) -> list[BatchItem]:
    """Parse and validate every input line; bad lines carry their error."""
    builder = RequestBuilder(engine.tokenizer, engine.limits)
    items = []
    for no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        item = BatchItem(line_no=no, custom_id=None)
        items.append(item)
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            item.error = f"line {no} is not valid JSON: {e.msg} (column {e.colno})"
            continue
        try:
            if not isinstance(obj, dict):
                raise ValueError("each line must be a JSON object")
            cid = obj.get("custom_id")
            item.custom_id = cid if isinstance(cid, str) else None
            if not isinstance(cid, str) or not cid:
                raise ValueError("custom_id must be a non-empty string")
            if obj.get("method", "POST") != "POST":
                raise ValueError(f"method must be POST, got {obj.get('method')!r}")
            item.url = obj.get("url", "")
            parsed = parse_body(item.url, obj.get("body"), engine.info.model_name)
            item.kind = parsed.kind
            item.request = builder.build(
                item.request_id,
                builder.tokenize(parsed.prompt),
                parsed.sampling,
                default_max_tokens=parsed.default_max_tokens,
                priority=parsed.priority,
            )
        except ValueError as e:
            item.error = f"line {no}: {e}"
    seen: set[str] = set()
    for item in items:
        if item.custom_id is not None and item.error is None:
            if item.custom_id in seen:
                item.error = f"line {item.line_no}: duplicate custom_id {item.custom_id!r}"
            seen.add(item.custom_id)
    return items


def run_items(
    engine: LLMEngine,
    items: list[BatchItem],
    progress: bool = True,
    on_finish: Callable[[BatchItem], None] | None = None,
) -> BatchSummary:
    """Submit every valid item at once and step the engine until all are done."""
    start = time.time()
    by_id: dict[str, BatchItem] = {}
    for item in items:
        req = item.request
        if req is None or item.error is not None:
            continue
        engine.add_request(
            req.request_id,
            req.prompt_token_ids,
            req.params,
            arrival_time=start,
            priority=req.priority,
        )
        by_id[item.request_id] = item
    bar = tqdm(
        total=len(by_id), unit="req", file=sys.stderr, disable=not progress, dynamic_ncols=True
    )
    out_tokens = 0
    try:
        while engine.has_unfinished():
            for out in engine.step():
                item = by_id[out.request_id]
                out_tokens += len(out.delta_token_ids)
                if out.logprobs:
                    item.logprobs.extend(out.logprobs)
                if out.finished:
                    item.output = out
                    bar.update(1)
                    if on_finish is not None:
                        on_finish(item)
            elapsed = time.time() - start
            if elapsed > 0:
                bar.set_postfix_str(f"{out_tokens / elapsed:.1f} tok/s", refresh=False)
    finally:
        bar.close()
    wall = time.time() - start
    return summarize(items, wall, engine.scheduler.kv.prefix_hit_rate)


def summarize(items: list[BatchItem], wall_s: float, prefix_hit_rate: float) -> BatchSummary:
    done = [i.output for i in items if i.output is not None]
    timings: list[TimingSummary] = [o.timing for o in done if o.timing is not None]
    return BatchSummary(
        requests=len(items),
        failed=sum(1 for i in items if i.error is not None or (i.output and i.output.error)),
        prompt_tokens=sum(o.num_prompt_tokens for o in done),
        output_tokens=sum(len(o.token_ids) for o in done),
        cached_tokens=sum(o.num_cached_tokens for o in done),
        wall_s=wall_s,
        ttft=[t.ttft_s for t in timings if t.ttft_s is not None],
        itl=[t.itl_mean_s for t in timings if t.itl_mean_s is not None],
        e2e=[t.e2e_s for t in timings],
        preemptions=sum(t.preemptions for t in timings),
        prefix_hit_rate=prefix_hit_rate,
    )


def result_line(item: BatchItem, engine: LLMEngine) -> dict[str, Any]:
    """The output JSONL object for one input line."""
    base: dict[str, Any] = {"id": f"batch_req_{item.request_id}", "custom_id": item.custom_id}
    out = item.output
    if item.error is not None or out is None or item.request is None:
        msg = item.error or (out.error if out is not None else None) or "request did not finish"
        return {
            **base,
            "response": {"status_code": 400, "request_id": item.request_id, "body": None},
            "error": {"code": "invalid_request", "message": msg},
        }
    if out.error is not None:
        return {
            **base,
            "response": {"status_code": 500, "request_id": item.request_id, "body": None},
            "error": {"code": "internal", "message": out.error},
        }
    body = response_body(
        item.kind,
        item.request_id,
        engine.info.model_name,
        _with_logprobs(out, item.logprobs),
        engine.tokenizer,
    )
    return {
        **base,
        "response": {"status_code": 200, "request_id": item.request_id, "body": body},
        "error": None,
        "kvflow": timing_fields(out),
    }


def _with_logprobs(out: RequestOutput, logprobs: list[TokenLogprobs]) -> RequestOutput:
    # Streamed outputs carry each step's logprobs; the response wants all of them.
    return replace(out, logprobs=logprobs) if logprobs else out


def timing_fields(out: RequestOutput) -> dict[str, Any]:
    """The per-request figures written beside each response: token counts and the
    contract's timing (its *_s fields), plus the longest inter-token gap."""
    fields: dict[str, Any] = {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": len(out.token_ids),
        "cached_tokens": out.num_cached_tokens,
    }
    if out.timing is not None:
        timing = timing_of(out, None, None)
        fields.update({k: v for k, v in timing.items() if k.endswith("_s")})
        fields.update(itl_max_s=out.timing.itl_max_s, preemptions=out.timing.preemptions)
    return fields


class Ledger(Protocol):
    def record(self, rec: RequestRecord) -> None: ...


def ledger_record(
    item: BatchItem, engine: LLMEngine, source_name: str, started: float
) -> RequestRecord:
    """The item's ledger row: the same shape the queue worker writes."""
    req, out = item.request, item.output
    origin = Origin(
        worker_id=f"run-batch:{socket.gethostname()}:{os.getpid()}",
        source=RequestSource.BATCH,
        model=engine.info.model_name,
        priority=req.priority if req is not None else None,
        received_at=started,  # no enqueue time: delays count from the engine's arrival
        metadata={"custom_id": item.custom_id, "batch": source_name, "line": item.line_no},
    )
    if req is None or out is None or item.error is not None:
        text = item.error or "the request did not finish"
        return error_record(item.request_id, Outcome.invalid(InvalidInput(text)), origin)
    return final_record(item.request_id, out, origin, prompt_tokens=len(req.prompt_token_ids))


def run_batch_file(
    engine: LLMEngine,
    input_path: Path,
    output: TextIO,
    progress: bool = True,
    ledger: Ledger | None = None,
) -> tuple[list[BatchItem], BatchSummary]:
    """Read, run and write a whole batch file; every request also goes to `ledger` if given."""
    started = time.time()
    with open(input_path, encoding="utf-8") as f:
        items = read_items(f, engine)

    def record(item: BatchItem) -> None:
        if ledger is not None:
            ledger.record(ledger_record(item, engine, input_path.name, started))

    for item in items:
        if item.error is not None:
            record(item)
    summary = run_items(engine, items, progress=progress, on_finish=record)
    for item in items:
        output.write(json.dumps(result_line(item, engine), ensure_ascii=False) + "\n")
    output.flush()
    return items, summary

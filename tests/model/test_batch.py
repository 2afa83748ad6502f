"""run-batch: OpenAI batch JSONL in, one result line per input line out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from worker.batch import read_items, result_line, run_items
from worker.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.model.loader import load_model


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    loaded = load_model(str(tiny_model_dir("smollm2")))
    return LLMEngine(EngineConfig(model=str(loaded.path), num_kv_blocks=256), loaded=loaded)


def line(cid: str, url: str = "/v1/chat/completions", **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def run(engine: LLMEngine, lines: list[str]) -> list[dict]:
    items = read_items(lines, engine)
    run_items(engine, items, progress=False)
    return [result_line(i, engine) for i in items]


def test_round_trip_chat_and_completion(engine) -> None:
    res = run(
        engine,
        [
            line("c1", messages=chat("hello"), max_tokens=5, temperature=0, ignore_eos=True),
            line(
                "t1",
                url="/v1/completions",
                prompt="Once upon",
                max_tokens=4,
                ignore_eos=True,
                seed=3,
            ),
            line(
                "t2",
                url="/v1/completions",
                prompt=[5, 6, 7],
                max_tokens=3,
                logprobs=2,
                ignore_eos=True,
            ),
            line(
                "c2",
                messages=chat("hi"),
                max_tokens=3,
                logprobs=True,
                top_logprobs=3,
                ignore_eos=True,
            ),
        ],
    )
    assert [r["custom_id"] for r in res] == ["c1", "t1", "t2", "c2"]
    c1 = res[0]["response"]
    assert c1["status_code"] == 200 and res[0]["error"] is None
    body = c1["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5
    assert body["choices"][0]["finish_reason"] == "length"
    k = res[0]["kvflow"]
    for f in (
        "queue_s",
        "ttft_s",
        "prefill_s",
        "decode_s",
        "e2e_s",
        "itl_mean_s",
        "itl_p99_s",
        "preemptions",
    ):
        assert f in k
    assert k["e2e_s"] >= k["ttft_s"] >= k["queue_s"] >= 0
    t1 = res[1]["response"]["body"]
    assert t1["object"] == "text_completion" and t1["usage"]["completion_tokens"] == 4
    t2 = res[2]["response"]["body"]["choices"][0]["logprobs"]
    assert len(t2["tokens"]) == 3 and all(len(d) <= 2 for d in t2["top_logprobs"])
    assert all(lp <= 0 for lp in t2["token_logprobs"])
    c2 = res[3]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(c2) == 3 and all(len(e["top_logprobs"]) == 3 for e in c2)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps([1, 2]), "JSON object"),
        (
            json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
            "custom_id",
        ),
        (line("u", url="/v1/embeddings", input="x"), "url must be"),
        (line("m", messages="hello"), "messages"),
        (line("p", url="/v1/completions"), "needs 'prompt'"),
        (line("t", messages=chat("x"), temperature=-1), "temperature"),
        (line("k", messages=chat("x"), top_k="5"), "top_k must be an integer"),
        (line("n", messages=chat("x"), n=2), "n must be 1"),
        (line("f", messages=chat("x"), frobnicate=1), "unknown field"),
        (line("l", url="/v1/completions", prompt="x" * 20000), "prompt has"),
        (line("v", url="/v1/completions", prompt=[10**8]), "outside the vocabulary"),
        (line("s", messages=chat("x"), stop=[1]), "stop strings"),
        (line("w", messages=chat("x"), model="gpt-4o"), "'gpt-4o' is not served here"),
        (line("x", messages=chat("x"), max_tokens=10**9), "more than the context leaves"),
        (line("y", url="/v1/completions", prompt="x", max_tokens=256), "at most 25"),
    ],
    ids=lambda v: v[:24] if isinstance(v, str) else None,
)
def test_bad_lines_become_errors_and_batch_goes_on(engine, raw: str, message: str) -> None:
    good = line("ok", messages=chat("fine"), max_tokens=2, ignore_eos=True)
    res = run(engine, [good, raw, good.replace('"ok"', '"ok2"')])
    assert len(res) == 3
    bad = res[1]
    assert bad["response"]["status_code"] == 400
    assert message in bad["error"]["message"], bad["error"]["message"]
    assert "line 2" in bad["error"]["message"]
    assert res[0]["response"]["status_code"] == 200 and res[2]["response"]["status_code"] == 200


def test_model_named_as_served_and_default_max_tokens_fit_the_context(engine) -> None:
    served = engine.info.model_name
    res = run(engine, [line("a", url="/v1/completions", prompt=[5, 6, 7], model=served)])
    body = res[0]["response"]["body"]
    assert res[0]["error"] is None and body["model"] == served
    assert body["usage"]["completion_tokens"] <= 16  # the completions default
    # a chat request without max_tokens may run to the end of the context, never past it
    items = read_items([line("b", messages=chat("x"))], engine)
    req = items[0].request
    assert req is not None
    assert len(req.prompt_token_ids) + req.params.max_tokens == engine.limits.max_model_len


def test_duplicate_custom_id_rejected(engine) -> None:
    res = run(
        engine,
        [
            line("same", messages=chat("a"), max_tokens=1),
            line("same", messages=chat("b"), max_tokens=1),
        ],
    )
    assert res[0]["response"]["status_code"] == 200
    assert "duplicate custom_id" in res[1]["error"]["message"]


def test_summary_figures(engine) -> None:
    lines = [line(f"r{i}", messages=chat(f"q{i}"), max_tokens=4, ignore_eos=True) for i in range(6)]
    items = read_items(lines, engine)
    s = run_items(engine, items, progress=False)
    assert s.requests == 6 and s.failed == 0 and s.output_tokens == 24
    assert s.prompt_tokens == sum(len(i.request.prompt_token_ids) for i in items if i.request)
    # every request shares the default system prompt: the prefix cache serves part of it
    assert s.cached_tokens > 0 and 0 < s.prefix_hit_rate < 1
    table = s.table()
    for label in (
        "output tok/s",
        "TTFT p50 / p99",
        "ITL p50 / p99",
        "e2e p50 / p99",
        "preemptions",
        "prefix-cache hit rate",
    ):
        assert label in table


@pytest.mark.slow
def test_cli_on_default_model(tmp_path: Path) -> None:
    """The README's main job, end to end through the console entry point."""
    example = Path(__file__).parents[2] / "ops" / "examples" / "batch.jsonl"
    out = tmp_path / "out.jsonl"
    bad = tmp_path / "in.jsonl"
    bad.write_text(example.read_text() + "this is not json\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker.cli",
            "run-batch",
            str(bad),
            "-o",
            str(out),
            "--show",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    n = len(example.read_text().splitlines())
    assert len(rows) == n + 1
    assert all(r["response"]["status_code"] == 200 for r in rows[:n])
    assert rows[-1]["response"]["status_code"] == 400
    assert "output tok/s" in proc.stderr and "TTFT" in proc.stderr
    texts = [
        r["response"]["body"]["choices"][0].get("message", {}).get("content")
        or r["response"]["body"]["choices"][0].get("text")
        for r in rows[:n]
    ]
    assert all(t.strip() for t in texts)
    assert "Paris" in proc.stdout  # "The capital of France is" ... from the real model

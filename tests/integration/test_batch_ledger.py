"""run-batch leaves the same trail in the ledger as the queue worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sqlalchemy import text

from worker.ledger.migrate import upgrade

ROOT = Path(__file__).resolve().parents[2]


def test_run_batch_records_every_request(tmp_path: Path, empty_schema, tiny_model_dir) -> None:
    url = empty_schema()
    upgrade(url)
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": f"item {i}", "max_tokens": 3, "ignore_eos": True},
        }
        for i in range(5)
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker.cli",
            "run-batch",
            str(src),
            "-o",
            str(out),
            "--no-progress",
            "--model",
            str(tiny_model_dir("smollm2")),
            "--database-url",
            url,
            "--threads",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(x) for x in out.read_text().splitlines()]
    ids = [r["response"]["request_id"] for r in results]

    import asyncio

    from worker.ledger.migrate import open_engine

    async def rows() -> list[dict]:
        engine = open_engine(url)
        try:
            async with engine.connect() as conn:
                res = await conn.execute(
                    text(
                        "select id, status, source, completion_tokens, ttft_s, e2e_s, queue_s, metadata, error_code "
                        "from requests order by id"
                    )
                )
                return [dict(r._mapping) for r in res]
        finally:
            await engine.dispose()

    got = {r["id"]: r for r in asyncio.run(rows())}
    assert set(got) == set(ids)
    for res, rid in zip(results, ids, strict=True):
        row = got[rid]
        assert row["source"] == "batch"
        assert row["metadata"]["custom_id"] == res["custom_id"]
        if res["response"]["status_code"] == 200:
            assert row["status"] == "completed" and row["completion_tokens"] == 3
            assert row["e2e_s"] >= row["ttft_s"] >= row["queue_s"] >= 0
            assert abs(row["ttft_s"] - res["kvflow"]["ttft_s"]) < 1e-6
        else:
            assert row["status"] == "rejected" and row["error_code"] == "invalid_request"
    assert sum(1 for r in got.values() if r["status"] == "completed") == 5


def test_run_batch_refuses_an_unmigrated_ledger(tmp_path: Path, empty_schema) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(
        json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}) + "\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker.cli",
            "run-batch",
            str(src),
            "-o",
            str(tmp_path / "o.jsonl"),
            "--database-url",
            empty_schema(),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "kvflow db upgrade" in proc.stderr

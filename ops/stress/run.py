"""Faults, load, hostile input and KV pressure against the local RabbitMQ and PostgreSQL,
the scenarios of tests/integration/test_stress.py; `--big` at full size (5,000 load,
10,000 fuzz, 1,000 under KV pressure). Prints a table and each scenario's details; exits
1 if any message was lost, duplicated, left unanswered or wrongly dead-lettered.

    python ops/stress/run.py --big [--only load,fuzz] [--out DIR]

RabbitMQ is restarted and PostgreSQL stopped during the run (holding the service lock,
tests/integration/stress.py); run it where that is allowed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from common import model_dir, table, world

from tests.integration import stress
from tests.integration.harness import LOOKAHEAD

SIZES = {  # CI's sizes, then --big
    "load": (2000, 5000),
    "fuzz": (3000, 10000),
    "kv": (200, 1000),
}
SEED = 20261130
KV_BLOCKS = 36


async def main(big: bool, only: set[str], out: Path) -> int:
    model = model_dir()
    size = {k: v[1] if big else v[0] for k, v in SIZES.items()}
    flag = " --big" if big else ""
    tallies: list[stress.Tally] = []
    commands: dict[str, str] = {}

    async def scenario(key: str, run: object) -> None:
        if only and key not in only:
            return
        began = time.monotonic()
        async with world(key, out) as h:
            tally = await run(h)  # type: ignore[operator]
        tally.seconds = time.monotonic() - began
        commands[tally.name] = f"python ops/stress/run.py{flag} --only {key}"
        tallies.append(tally)
        print(tally.summary(), flush=True)

    await scenario("rabbitmq", lambda h: stress.rabbitmq_restart(h, model))
    await scenario("postgres", lambda h: stress.postgres_outage(h, model))
    await scenario("kill", lambda h: stress.kill_twice(h, model))

    async def load(h: object) -> stress.Tally:
        tally, held, mem = await stress.load(h, model, size["load"])  # type: ignore[arg-type]
        cap = 8 + LOOKAHEAD  # stress.load's max_num_seqs and the harness's look-ahead
        for wid, n in held.max_running.items():
            if n > cap or held.max_held[wid] > cap:
                tally.bad(f"{wid} held {n} (heartbeat {held.max_held[wid]}), over {cap}")
        tally.notes["rss growth after warm-up"] = {
            k: round(v, 4) for k, v in mem.growth(warm_from=size["load"] // 5).items()
        }
        return tally

    await scenario("load", load)
    await scenario("fuzz", lambda h: stress.fuzz(h, model, size["fuzz"], seed=SEED))

    async def kv(h: object) -> stress.Tally:
        n = size["kv"]
        expected = await asyncio.to_thread(stress.reference_outputs, model, n)
        tally, mem, _ = await stress.kv_pressure(h, model, n, expected, KV_BLOCKS)  # type: ignore[arg-type]
        tally.notes["rss growth, last 100 vs first 100"] = {
            k: round(v, 4) for k, v in mem.growth(warm_from=100, last_from=n - 100).items()
        }
        return tally

    await scenario("kv", kv)

    print()
    print(table(tallies, commands))
    results = out / "results.json"
    results.write_text(json.dumps([{**t.__dict__} for t in tallies], indent=2, default=str))
    print(f"\ndetails in {results}; worker logs under {out}")
    return 0 if all(t.clean for t in tallies) else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--big", action="store_true", help="full size (else CI's sizes)")
    p.add_argument(
        "--only", default="", help="comma-separated: rabbitmq,postgres,kill,load,fuzz,kv"
    )
    p.add_argument("--out", type=Path, default=None, help="where logs and results go")
    a = p.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="kvflow-stress-"))
    sys.exit(asyncio.run(main(a.big, {x for x in a.only.split(",") if x}, out)))

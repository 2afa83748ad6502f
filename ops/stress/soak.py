"""Soak: mixed traffic (valid requests and hostile messages) to two workers for N minutes
(default 30), a fault every minute in turn (RabbitMQ restarted, PostgreSQL stopped, a
worker killed with SIGKILL), then every message accounted for in a final table. Exits 1
if any was lost, duplicated, left unanswered or wrongly dead-lettered.

    python ops/stress/soak.py [--minutes 30] [--seed 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from common import model_dir, table, world

from tests.integration import stress


async def main(minutes: float, seed: int, out: Path) -> int:
    model = model_dir()
    async with world("soak", out) as h:
        tally = await stress.soak(h, model, minutes, seed)
    print(tally.summary())
    print()
    cmd = f"python ops/stress/soak.py --minutes {minutes:g} --seed {seed}"
    print(table([tally], {tally.name: cmd}))
    (out / "soak.json").write_text(json.dumps(tally.__dict__, indent=2, default=str))
    print(f"\ndetails in {out / 'soak.json'}")
    return 0 if tally.clean else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="kvflow-soak-"))
    sys.exit(asyncio.run(main(a.minutes, a.seed, out)))

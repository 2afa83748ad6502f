"""worker.service.settle_heap: the start-up heap frozen, young collections spaced out."""

from __future__ import annotations

import json
import subprocess
import sys

CHECK = """
import gc, json
from worker.service import GC_YOUNG_THRESHOLD, settle_heap
before = (gc.get_freeze_count(), gc.get_threshold())
settle_heap()
print(json.dumps({"before": before, "frozen": gc.get_freeze_count(),
                  "threshold": gc.get_threshold(), "want": GC_YOUNG_THRESHOLD}))
"""


def test_settle_heap_freezes_what_is_alive_and_raises_the_young_threshold() -> None:
    # In a fresh interpreter: freezing this test process would keep its garbage for good.
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, check=True, timeout=120
    )
    got = json.loads(out.stdout)
    frozen_before, threshold_before = got["before"]
    assert frozen_before == 0
    assert got["frozen"] > 10_000  # the imported modules' objects, at least
    assert got["threshold"] == [got["want"], threshold_before[1], threshold_before[2]]

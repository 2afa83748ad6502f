"""The engine benchmark's alternating pairs against llama-server (ops/bench/engine.py):
the ratio quoted is the ratio of the two systems' medians, each pair's own ratio beside
it, and the table and plot say which slot count llama-server ran at."""

from __future__ import annotations

import pytest

from tests.bench_modules import load_bench

engine_bench = load_bench("engine")
Pair = engine_bench.Pair


def test_ratio_of_medians_is_not_the_median_of_ratios() -> None:
    pairs = [Pair(200.0, 50.0), Pair(140.0, 50.0), Pair(190.0, 40.0)]
    # medians 190 and 50; the pairs' own ratios are 4.00, 2.80 and 4.75
    assert engine_bench.ratio_of_medians(pairs) == pytest.approx(3.8)
    assert [p.ratio for p in pairs] == pytest.approx([4.0, 2.8, 4.75])
    summary = engine_bench.pairs_summary(pairs)
    assert "3 alternating pairs: 3.80x the medians" in summary
    assert "190.0 against 50.0" in summary
    assert "pairs 2.80-4.75x" in summary


def test_pairs_table_lists_each_round_then_the_medians() -> None:
    md = engine_bench.pairs_table([Pair(150.0, 60.0), Pair(120.0, 40.0)], slots=8)
    lines = md.splitlines()
    assert "llama-server at 8 slots" in lines[0]
    assert "| 1 | 150.0 | 60.0 | 2.50x |" in lines
    assert "| 2 | 120.0 | 40.0 | 3.00x |" in lines
    assert lines[-1] == "| median | 135.0 | 50.0 | 2.70x |"


def test_plot_pairs_writes_a_png(tmp_path) -> None:
    path = tmp_path / "pairs.png"
    engine_bench.plot_pairs([Pair(150.0, 60.0), Pair(120.0, 40.0)], 4, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

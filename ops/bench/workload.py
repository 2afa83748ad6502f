"""The benchmark workload: prompts cut from real text, long-tailed output lengths."""

from __future__ import annotations

import importlib
import inspect
import math
import sys
from dataclasses import dataclass

import numpy as np


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def describe(self) -> str:
        return (
            f"{len(self.prompts)} requests, prompt tokens {self.prompt_tokens} "
            f"({min(map(len, self.prompts))}-{max(map(len, self.prompts))} each), output tokens "
            f"{self.output_tokens} (median {int(np.median(self.output_lens))}, max {max(self.output_lens)})"
        )


def corpus_tokens(tokenizer, n_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Token ids of real English text: the standard library's docstrings.

    Only the standard library's modules (`sys.stdlib_module_names`): what else is
    installed, or lies beside the script that runs this, neither changes the text nor is
    imported."""
    texts: list[str] = []
    skip = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"}
    for mod in sorted(m for m in sys.stdlib_module_names if not m.startswith("_")):
        if mod in skip:
            continue
        try:
            module = importlib.import_module(mod)
        except Exception:
            continue
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj) if callable(obj) else None
            if doc and len(doc) > 200:
                texts.append(doc)
        if sum(len(t) for t in texts) > n_tokens * 6:
            break
    return tokenizer.encode("\n\n".join(texts), add_special_tokens=False)[:n_tokens]


def make_workload(
    tokenizer,  # type: ignore[no-untyped-def]
    n: int,
    seed: int = 0,
    prompt_range: tuple[int, int] = (16, 512),
    output_range: tuple[int, int] = (8, 512),
    output_median: int = 64,
) -> Workload:
    """n requests: prompt lengths uniform in prompt_range, outputs lognormal (sigma 1)
    around output_median, clipped to output_range; prompts share no prefix."""
    rng = np.random.default_rng(seed)
    lo, hi = prompt_range
    prompt_lens = rng.integers(lo, hi + 1, n)
    out = np.round(rng.lognormal(math.log(output_median), 1.0, n))
    out_lens = np.clip(out, *output_range).astype(int)
    stream = corpus_tokens(tokenizer, 200_000)
    starts = rng.integers(0, len(stream) - hi - 1, n)
    prompts = [stream[s : s + int(k)] for s, k in zip(starts, prompt_lens, strict=True)]
    return Workload(prompts, [int(x) for x in out_lens])


def make_longtail_workload(
    tokenizer,  # type: ignore[no-untyped-def]
    n: int = 64,
    seed: int = 0,
    max_prompt: int = 350,
    output_range: tuple[int, int] = (8, 141),
    output_median: int = 32,
    shared_fraction: float = 0.75,
) -> Workload:
    """n requests at once, as a batch job sends them: outputs lognormal (sigma 0.9)
    around output_median, clipped to output_range (~3,000 tokens for 64); prompts of
    up to max_prompt tokens, of which shared_fraction open with one of four shared
    preambles (80-200 tokens, as a shared instruction or document would) before their
    own text."""
    rng = np.random.default_rng(seed)
    out = np.round(rng.lognormal(math.log(output_median), 0.9, n))
    out_lens = np.clip(out, *output_range).astype(int)
    stream = corpus_tokens(tokenizer, 200_000)
    openings = []
    for _ in range(4):
        k = int(rng.integers(80, 201))
        s = int(rng.integers(0, len(stream) - k - 1))
        openings.append(stream[s : s + k])
    prompts: list[list[int]] = []
    for _ in range(n):
        head = openings[int(rng.integers(0, 4))] if rng.random() < shared_fraction else []
        k = int(rng.integers(16, max_prompt - len(head) + 1))
        s = int(rng.integers(0, len(stream) - k - 1))
        prompts.append(head + stream[s : s + k])
    return Workload(prompts, [int(x) for x in out_lens])

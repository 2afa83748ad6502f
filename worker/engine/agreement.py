"""Next-token agreement under teacher forcing: how often a runner's greedy pick equals a
reference's at every position of known continuations (the bar a narrower dtype or kernel
must clear before `auto` takes it; the tests and the GPU check measure with it)."""

from __future__ import annotations

from collections.abc import Sequence

from worker.engine.model_runner import ModelRunner
from worker.engine.outputs import ScheduledRequest
from worker.request import SamplingParams


def prefill_agreement(
    runner: ModelRunner, prompts: Sequence[list[int]], continuations: Sequence[list[int]]
) -> tuple[int, int]:
    """(agreeing, total) next tokens: each prompt and its reference continuation in one
    prefill pass of `runner` (sequence i in cache blocks of its own, i * per .. (i + 1) *
    per), the pick at the prompt's last position and every continuation token but the
    last compared with the next continuation token."""
    bs = runner.config.block_size
    per = max(-(-(len(p) + len(c)) // bs) for p, c in zip(prompts, continuations, strict=True))
    if per * len(prompts) > runner.info.num_blocks:
        raise ValueError(
            f"{len(prompts)} sequences of up to {per} blocks do not fit the runner's "
            f"{runner.info.num_blocks} cache blocks"
        )
    agree = total = 0
    for i, (prompt, cont) in enumerate(zip(prompts, continuations, strict=True)):
        n = len(prompt) + len(cont) - 1  # the last token is never an input
        step = ScheduledRequest(
            request_id=str(i),
            token_ids=prompt + cont,
            start=0,
            num_new_tokens=n,
            block_ids=list(range(i * per, (i + 1) * per)),
            num_prompt_tokens=len(prompt),
            sampling_params=SamplingParams(temperature=0.0),
            eos_token_ids=(),
        )
        logits = runner.all_logits([step])[str(i)]  # [n, V]
        picks = logits[len(prompt) - 1 :].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(picks, cont, strict=True))
        total += len(cont)
    return agree, total

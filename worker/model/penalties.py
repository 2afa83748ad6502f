"""min_tokens bans and repetition / frequency / presence penalties on a batch of logits."""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain

import torch

from worker.model.sampling_types import SamplingRow


def penalized(logits: torch.Tensor, rows: Sequence[SamplingRow], shared: bool) -> torch.Tensor:
    """float32 logits [N, V] after min_tokens bans and penalties.

    A float32 `logits` is changed in place unless `shared`, then copied only if a row
    needs a change; with nothing to change it comes back as it is.
    """
    vocab, device = logits.shape[1], logits.device
    ban_rows: list[int] = []
    ban_cols: list[int] = []
    for i, r in enumerate(rows):
        if r.output_index < r.params.min_tokens:
            # An id outside the logits cannot be sampled, so needs no ban.
            ids = [t for t in r.min_tokens_stop_ids if 0 <= t < vocab]
            ban_rows += [i] * len(ids)
            ban_cols += ids
    penalized = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if not ban_rows and not penalized:
        return logits.float()
    x = logits.to(torch.float32, copy=shared)
    if ban_rows:
        x[index_tensor(ban_rows, device), index_tensor(ban_cols, device)] = -math.inf
    if len(penalized) == len(rows):
        x = apply_penalties(x, list(rows))
    elif penalized:
        idx = index_tensor(penalized, device)
        x[idx] = apply_penalties(x.index_select(0, idx), [rows[i] for i in penalized])
    return x


def apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition, then frequency and presence penalties, as vLLM applies them: x [P, V]."""
    vocab, device = x.shape[1], x.device
    ps = [r.params for r in rows]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]  # [P, 1]

    # Occurrences of each token in each row's output [P, V] (float sums of ones: exact).
    keys = flat_keys([r.output_token_ids for r in rows], vocab, device)
    counts = x.new_zeros(len(rows) * vocab).index_add_(0, keys, x.new_ones(keys.shape))
    counts = counts.view(len(rows), vocab)
    present = counts.clamp(max=1)  # [P, V] 1.0 where the token was generated
    if any(p.repetition_penalty != 1.0 for p in ps):
        prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else () for r in rows]
        seen = present.clone()  # [P, V] 1.0 where the token is in the prompt or the output
        seen.view(-1).index_fill_(0, flat_keys(prompts, vocab, device), 1.0)
        # rep where the token was seen, 1 elsewhere; positive logits are divided by it,
        # the others multiplied (clamps: cheaper than a masked where on CPU).
        factor = seen.mul_(column([p.repetition_penalty for p in ps]) - 1).add_(1)
        x = x.clamp(min=0).div_(factor).add_(x.clamp(max=0).mul_(factor))
    if any(p.frequency_penalty != 0.0 for p in ps):
        x -= counts.mul_(column([p.frequency_penalty for p in ps]))
    if any(p.presence_penalty != 0.0 for p in ps):
        x -= present.mul_(column([p.presence_penalty for p in ps]))
    return x


def flat_keys(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """row * vocab + token id for every token of every sequence: [total] int64."""
    flat = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab):
        raise ValueError(f"token ids must be in [0, {vocab}) to apply penalties")
    offsets = torch.arange(len(seqs), dtype=torch.int64) * vocab
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    return (flat + offsets.repeat_interleave(lengths)).to(device)


def index_tensor(ids: list[int], device: torch.device) -> torch.Tensor:
    """Row or column ids as an int64 index tensor on `device`."""
    return torch.tensor(ids, dtype=torch.int64, device=device)

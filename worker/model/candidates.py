"""Tensor kernels of the sampler: block argmax, best-first candidates, filtered race.

Pure functions of tensors, no sampling state: the Sampler (sampler.py) calls them.
"""

from __future__ import annotations

import torch

# Block sizes for the two-level argmax (several times faster than torch.argmax on CPU)
# and for narrowing the candidate search to the blocks with the highest maxima.
_ARGMAX_BLOCK = 128
_CANDIDATE_BLOCK = 32


def race_candidates(
    vals: torch.Tensor,
    cols: torch.Tensor,
    times: torch.Tensor,
    vocab: int,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    log_min_p: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Filter and race among best-first candidates vals, cols, times [P, C].

    Returns the winners' token ids [P] and whether each row's result is exact [P]:
    the kept set provably lies inside the candidates (always so when C == V).
    """
    width = vals.shape[1]
    full = width == vocab
    top = vals[:, :1]  # [P, 1] the row's max logit
    last = vals[:, -1]  # [P] the weakest candidate

    has_k = top_k > 0
    kth = vals.gather(1, (top_k.clamp(1, width) - 1)[:, None])  # [P, 1]
    keep = (vals >= kth) | ~has_k[:, None]  # ties with the k-th value stay, as in vLLM
    k_inside = has_k & (last < kth[:, 0]) if not full else has_k

    # top_p sees the distribution left by top_k: its normaliser is the kept candidates'
    # when they hold the whole top-k set, else the whole row's.
    w = (vals - top).exp_() * keep  # [P, C] unnormalised kept probabilities
    log_z = torch.where(k_inside, top[:, 0] + w.sum(-1).log(), lse)
    probs = w * (top - log_z[:, None]).exp()  # [P, C]
    cum = probs.cumsum(-1)
    has_p = top_p < 1
    keep &= ((cum - probs) < top_p[:, None]) | ~has_p[:, None]  # mass before it below top_p
    p_inside = has_p & (cum[:, -1] >= top_p)

    min_logit = top[:, 0] + log_min_p  # [P] prob >= min_p * max prob, in logit space
    keep &= vals >= min_logit[:, None]
    min_p_inside = last < min_logit

    if full:
        done = torch.ones_like(has_k)
    else:
        normaliser_known = ~has_p | ~has_k | k_inside
        done = (k_inside | p_inside | min_p_inside) & normaliser_known
    score = w.mul_(keep).div_(times)  # [P, C]; dropped candidates score 0
    return cols.gather(1, score.argmax(-1, keepdim=True))[:, 0], done


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) for x [R, V] (first index of the max), via block maxima."""
    vocab = x.shape[1]
    if vocab < 2 * _ARGMAX_BLOCK:
        return x.argmax(-1)
    first = block_max(x, _ARGMAX_BLOCK).argmax(-1, keepdim=True)  # [R, 1] first block with the max
    # Columns of that block [R, B]; the short tail block repeats its last column, which
    # cannot come before the real one.
    cols = first * _ARGMAX_BLOCK + torch.arange(_ARGMAX_BLOCK, device=x.device)
    cols.clamp_(max=vocab - 1)
    return cols.gather(1, x.gather(1, cols).argmax(-1, keepdim=True))[:, 0]


def top_candidates(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` largest entries of each row of x [R, V], best first: (values, columns)."""
    vocab = x.shape[1]
    if width >= vocab:
        return x.sort(-1, descending=True)
    if 4 * width * _CANDIDATE_BLOCK > vocab:
        return x.topk(width, -1)
    # The best `width` entries lie in the `width` blocks with the highest maxima (a block
    # left out has a max no better than every chosen block's) or in the short tail, so
    # topk only scans those.
    nb = vocab // _CANDIDATE_BLOCK
    head = x[:, : nb * _CANDIDATE_BLOCK].view(x.shape[0], nb, _CANDIDATE_BLOCK)  # [R, nb, B]
    blocks = head.amax(-1).topk(width, -1, sorted=False).indices  # [R, width]
    cols = blocks[:, :, None] * _CANDIDATE_BLOCK + torch.arange(_CANDIDATE_BLOCK, device=x.device)
    cols = cols.flatten(1)  # [R, width * B]
    if vocab % _CANDIDATE_BLOCK:
        tail = torch.arange(nb * _CANDIDATE_BLOCK, vocab, device=x.device)
        cols = torch.cat([cols, tail.expand(x.shape[0], -1)], 1)
    best = x.gather(1, cols).topk(width, -1)
    return best.values, cols.gather(1, best.indices)


def block_max(x: torch.Tensor, block: int) -> torch.Tensor:
    """Maxima of consecutive blocks of `block` columns of x [R, V]: [R, ceil(V / block)]."""
    vocab = x.shape[1]
    nb = vocab // block
    out: torch.Tensor = x[:, : nb * block].view(x.shape[0], nb, block).amax(-1)
    if vocab % block:
        out = torch.cat([out, x[:, nb * block :].amax(-1, keepdim=True)], -1)
    return out


def greedy_pick(narrow: torch.Tensor, cols: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """torch.argmax of each row of narrow [S, V] widened to float32 with exact [S, k]
    written over its columns cols [S, k] (a narrow output projection's logits with its k
    best candidates, distinct columns, scored again), without widening the rows where it
    can.

    No column outside a row's candidates is above the lowest of their narrow values, so a
    row whose best exact score is above that floor takes its best candidate (the lowest
    column among equal scores, as argmax would); any other row (its candidates all scored
    down to the floor or under, or a NaN among them) takes the argmax of its whole
    widened row."""
    floor = narrow.gather(1, cols).amin(dim=1, keepdim=True).float()  # [S, 1]
    best = exact.max(dim=1, keepdim=True).values  # [S, 1], NaN where one is
    # [S, k] the columns holding the best score; the lowest of them
    at = torch.where(exact == best, cols, narrow.shape[1]).min(dim=1).values  # [S]
    doubtful = (~(best > floor))[:, 0].nonzero()[:, 0].tolist()
    for s in doubtful:
        row = narrow[s].float().scatter_(0, cols[s], exact[s])
        at[s] = row.argmax()
    return at

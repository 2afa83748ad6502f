"""Batched token sampling on the logits' device.

One call per engine step, all rows together:
  1. min_tokens bans and repetition / frequency / presence penalties on a float32 copy
     (only the rows that need them pay for them);
  2. greedy rows (temperature 0, or below 1e-5): argmax;
  3. random rows: divide by temperature, filter (top_k, then top_p, then min_p), sample;
  4. logprobs of the raw logits for rows that ask, then one device-to-host transfer.

Sampling is an exponential race: with E_i ~ Exp(1) i.i.d., argmax_i p_i / E_i is token i
with probability p_i, and the normaliser of p does not matter. A row with a seed takes
its E from a generator seeded from (seed, output_index) only, drawn over the whole
vocabulary and indexed by token id, so its choice depends on nothing else in the batch
and repeats after a preemption.

Filtered rows race among their best C candidates instead of the whole vocabulary (topk
over the C blocks of 32 columns with the highest maxima: no full sort). Each filter's
kept set is a prefix of the best-first order, so when one of them provably ends inside
the candidates (k < C, nucleus mass reached, min_p threshold above the C-th value) the
result is exact; the other rows retry with a wider C and, last, a full sort. Ties at the
top_k threshold are all kept, as in vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from worker.request import SamplingParams

# Candidate widths tried, in order, for rows with top_k / top_p / min_p; then a full sort.
_CANDIDATE_WIDTHS = (64, 1024)
# Block sizes for the two-level argmax (several times faster than torch.argmax on CPU)
# and for narrowing the candidate search to the blocks with the highest maxima.
_ARGMAX_BLOCK = 128
_CANDIDATE_BLOCK = 32
# Temperatures below this sample greedily, as in vLLM: 1 / T would overflow float32.
_MIN_TEMPERATURE = 1e-5
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    output_index: int  # tokens generated so far by this request (0 for its first token)
    prompt_token_ids: Sequence[int]  # read only; for repetition_penalty
    output_token_ids: Sequence[int]  # read only; for all three penalties
    # EOS ids + stop_token_ids, banned while output_index < params.min_tokens.
    min_tokens_stop_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (of the raw logits) for one sampled token."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), best first, len = params.logprobs


@dataclass(frozen=True)
class SamplerOutput:
    """One sampled token per row, and logprobs where the row asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


class Sampler:
    """Samples one token per row of a [N, V] logits tensor; see the module docstring.

    `seed` seeds the sampler's own generator, used by rows without a seed of their own.
    """

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
        n, vocab = logits.shape
        if n != len(rows):
            raise ValueError(f"logits has {n} rows but {len(rows)} sampling rows were given")
        if not logits.is_floating_point() or vocab == 0:
            raise ValueError(f"logits must be a non-empty float tensor, got {logits.dtype}")
        if logits.device != self._generator.device:
            raise ValueError(f"logits are on {logits.device}, the sampler on {self.device}")
        if n == 0:
            return SamplerOutput(token_ids=[], logprobs=[])

        greedy: list[int] = []
        plain: list[int] = []  # random rows without top_k / top_p / min_p
        filtered: list[int] = []
        for i, r in enumerate(rows):
            p = r.params
            if p.temperature < _MIN_TEMPERATURE:
                greedy.append(i)
            else:
                (filtered if _filters(p, vocab) else plain).append(i)
        tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
        groups = ((greedy, None), (plain, self._race_full), (filtered, self._race_filtered))
        for ids, race in groups:
            if not ids:
                continue
            idx = _index(ids, logits.device)
            group = [rows[i] for i in ids]
            if len(ids) == n:  # the caller's tensor: copied if anything is to change
                x = _penalized(logits, group, shared=True)
            else:
                x = _penalized(logits.index_select(0, idx), group, shared=False)
            # x: [len(ids), V] float32, read only from here on.
            tokens[idx] = _argmax(x) if race is None else race(x, group)
        return _output(logits, rows, tokens)

    def _race_full(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Sampling over the whole vocabulary: logits x [R, V] -> token ids [R].

        Seeded rows race (their draws depend on their seed alone); unseeded rows use the
        inverse CDF, one uniform per row instead of one per vocabulary entry (~10x
        cheaper on CPU for a 50k vocabulary, the same distribution).
        """
        inv_t = _inverse_temperatures(rows, x.device)  # [R, 1]
        # [R, V] unnormalised probabilities of x / T; neither method needs the normaliser.
        q = (x - x.amax(-1, keepdim=True)).mul_(inv_t).exp_()
        seeded = [j for j, r in enumerate(rows) if r.params.seed is not None]
        if not seeded:
            return self._inverse_cdf(q)
        if len(seeded) == len(rows):
            return _argmax(q.div_(self._race_times(rows, x.shape[1], x.device)))
        out = torch.empty(len(rows), dtype=torch.int64, device=x.device)
        s_idx = _index(seeded, x.device)
        plain = [j for j in range(len(rows)) if rows[j].params.seed is None]
        p_idx = _index(plain, x.device)
        qs = q.index_select(0, s_idx)
        out[s_idx] = _argmax(
            qs.div_(self._race_times([rows[j] for j in seeded], x.shape[1], x.device))
        )
        out[p_idx] = self._inverse_cdf(q.index_select(0, p_idx))
        return out

    def _inverse_cdf(self, q: torch.Tensor) -> torch.Tensor:
        """Token ids [R] drawn from unnormalised probabilities q [R, V] (q is consumed)."""
        cdf = q.cumsum_(-1)  # [R, V]
        total = cdf[:, -1:]
        u = torch.rand(q.shape[0], 1, generator=self._generator, device=q.device) * total
        # u < total strictly, and side="right" never picks a zero-probability token.
        u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, u, side="right").squeeze(1).clamp_(max=q.shape[1] - 1)

    def _race_filtered(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """top_k, top_p, min_p and the race among candidates: logits x [R, V] -> token ids [R]."""
        vocab, device = x.shape[1], x.device
        ps = [r.params for r in rows]
        inv_t = _inverse_temperatures(rows, device)  # [R, 1]
        top_k = torch.tensor([p.top_k if p.top_k < vocab else 0 for p in ps], device=device)
        top_p = torch.tensor([p.top_p for p in ps], device=device)
        log_min_p = torch.tensor(
            [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in ps], device=device
        )
        # log of the softmax normaliser of x / T [R]; needed by top_p rows without top_k.
        if any(p.top_p < 1 for p in ps):
            m = x.amax(-1, keepdim=True)  # [R, 1]
            lse = (m * inv_t)[:, 0] + (x - m).mul_(inv_t).exp_().sum(-1).log_()
        else:
            lse = x.new_zeros(len(ps))

        widths = [w for w in _CANDIDATE_WIDTHS if w < vocab]
        # k + 1 candidates settle a top_k row (its k-th value must beat the last one).
        k_max = max((p.top_k for p in ps if p.top_k < vocab), default=0)
        if widths and widths[0] < k_max + 1 < vocab:
            widths = sorted({*widths, k_max + 1})

        out = torch.empty(len(rows), dtype=torch.int64, device=device)
        ids = list(range(len(rows)))  # the rows still to settle
        for width in (*widths, vocab):
            idx = _index(ids, device)
            xs = x if len(ids) == len(rows) else x.index_select(0, idx)
            vals, cols = _top_candidates(xs, width)  # [P, C] best first
            times = self._race_times([rows[i] for i in ids], vocab, device, cols)
            token, done = _race_candidates(
                vals.mul_(inv_t[idx]),
                cols,
                times,
                vocab,
                top_k[idx],
                top_p[idx],
                log_min_p[idx],
                lse[idx],
            )
            out[idx] = token
            # One host sync per width; settled rows keep their token.
            ids = [i for i, d in zip(ids, done.tolist(), strict=True) if not d]
            if not ids:
                break
        return out

    def _race_times(
        self,
        rows: list[SamplingRow],
        vocab: int,
        device: torch.device,
        cols: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Exp(1) arrival times [R, V], or [R, C] for the token ids in cols [R, C].

        Unseeded rows draw from the sampler's generator in one call. A seeded row draws
        its whole vocabulary from its own generator and picks the times of its tokens,
        so a token's time is the same whichever candidates it is among.
        """
        width = vocab if cols is None else cols.shape[1]
        u = torch.empty(len(rows), width, device=device)
        unseeded = [j for j, r in enumerate(rows) if r.params.seed is None]
        if len(unseeded) == len(rows):
            u.uniform_(generator=self._generator)
        elif unseeded:
            u[_index(unseeded, device)] = torch.rand(
                len(unseeded), width, generator=self._generator, device=device
            )
        for j, r in enumerate(rows):
            if r.params.seed is None:
                continue
            gen = torch.Generator(device=device)
            gen.manual_seed(_row_seed(r.params.seed, r.output_index))
            draw = torch.rand(vocab, generator=gen, device=device)
            u[j] = draw if cols is None else draw[cols[j]]
        # -log(U), U in [0, 1): never 0, so p / E is never 0 / 0; U == 0 gives +inf (never wins).
        return u.log_().neg_()


def _race_candidates(
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


def _penalized(logits: torch.Tensor, rows: Sequence[SamplingRow], shared: bool) -> torch.Tensor:
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
        x[_index(ban_rows, device), _index(ban_cols, device)] = -math.inf
    if len(penalized) == len(rows):
        x = _apply_penalties(x, list(rows))
    elif penalized:
        idx = _index(penalized, device)
        x[idx] = _apply_penalties(x.index_select(0, idx), [rows[i] for i in penalized])
    return x


def _apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition, then frequency and presence penalties, as vLLM applies them: x [P, V]."""
    vocab, device = x.shape[1], x.device
    ps = [r.params for r in rows]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]  # [P, 1]

    # Occurrences of each token in each row's output [P, V] (float sums of ones: exact).
    keys = _flat_keys([r.output_token_ids for r in rows], vocab, device)
    counts = x.new_zeros(len(rows) * vocab).index_add_(0, keys, x.new_ones(keys.shape))
    counts = counts.view(len(rows), vocab)
    present = counts.clamp(max=1)  # [P, V] 1.0 where the token was generated
    if any(p.repetition_penalty != 1.0 for p in ps):
        prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else () for r in rows]
        seen = present.clone()  # [P, V] 1.0 where the token is in the prompt or the output
        seen.view(-1).index_fill_(0, _flat_keys(prompts, vocab, device), 1.0)
        # rep where the token was seen, 1 elsewhere; positive logits are divided by it,
        # the others multiplied (clamps: cheaper than a masked where on CPU).
        factor = seen.mul_(column([p.repetition_penalty for p in ps]) - 1).add_(1)
        x = x.clamp(min=0).div_(factor).add_(x.clamp(max=0).mul_(factor))
    if any(p.frequency_penalty != 0.0 for p in ps):
        x -= counts.mul_(column([p.frequency_penalty for p in ps]))
    if any(p.presence_penalty != 0.0 for p in ps):
        x -= present.mul_(column([p.presence_penalty for p in ps]))
    return x


def _flat_keys(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """row * vocab + token id for every token of every sequence: [total] int64."""
    flat = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab):
        raise ValueError(f"token ids must be in [0, {vocab}) to apply penalties")
    offsets = torch.arange(len(seqs), dtype=torch.int64) * vocab
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    return (flat + offsets.repeat_interleave(lengths)).to(device)


def _output(
    logits: torch.Tensor, rows: Sequence[SamplingRow], tokens: torch.Tensor
) -> SamplerOutput:
    """Logprobs from the raw logits; everything comes to the host in one transfer."""
    n = len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    n_top = min(max((rows[i].params.logprobs or 0 for i in want), default=0), logits.shape[1])
    parts = [tokens.double()]
    if want:
        idx = _index(want, logits.device)
        lp = torch.log_softmax(logits.index_select(0, idx).float(), -1)  # [L, V]
        parts.append(lp.gather(1, tokens[idx][:, None])[:, 0].double())  # [L]
        if n_top:
            values, cols = _top_candidates(lp, n_top)  # [L, n_top] best first
            parts += [values.flatten().double(), cols.flatten().double()]
    flat = torch.cat(parts).tolist()

    token_ids = [int(t) for t in flat[:n]]
    logprobs: list[TokenLogprobs | None] = [None] * n
    n_lp = len(want)
    top_vals = flat[n + n_lp : n + n_lp + n_lp * n_top]
    top_ids = flat[n + n_lp + n_lp * n_top :]
    for j, i in enumerate(want):
        k = rows[i].params.logprobs or 0
        base = j * n_top
        top = tuple((int(top_ids[base + t]), top_vals[base + t]) for t in range(min(k, n_top)))
        logprobs[i] = TokenLogprobs(token_id=token_ids[i], logprob=flat[n + j], top=top)
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) for x [R, V] (first index of the max), via block maxima."""
    vocab = x.shape[1]
    if vocab < 2 * _ARGMAX_BLOCK:
        return x.argmax(-1)
    first = _block_max(x, _ARGMAX_BLOCK).argmax(-1, keepdim=True)  # [R, 1] first block with the max
    # Columns of that block [R, B]; the short tail block repeats its last column, which
    # cannot come before the real one.
    cols = first * _ARGMAX_BLOCK + torch.arange(_ARGMAX_BLOCK, device=x.device)
    cols.clamp_(max=vocab - 1)
    return cols.gather(1, x.gather(1, cols).argmax(-1, keepdim=True))[:, 0]


def _top_candidates(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def _block_max(x: torch.Tensor, block: int) -> torch.Tensor:
    """Maxima of consecutive blocks of `block` columns of x [R, V]: [R, ceil(V / block)]."""
    vocab = x.shape[1]
    nb = vocab // block
    out: torch.Tensor = x[:, : nb * block].view(x.shape[0], nb, block).amax(-1)
    if vocab % block:
        out = torch.cat([out, x[:, nb * block :].amax(-1, keepdim=True)], -1)
    return out


def _inverse_temperatures(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    return torch.tensor([1.0 / r.params.temperature for r in rows], device=device)[:, None]


def _filters(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64, device=device)


def _row_seed(seed: int, output_index: int) -> int:
    """A 64-bit generator seed from (seed, output_index) only (splitmix64 mixing)."""
    return _mix64(_mix64(seed & _MASK64) ^ output_index)


def _mix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)

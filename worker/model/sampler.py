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
from collections.abc import Callable, Sequence

import torch

from worker.hardware import resolve_device
from worker.model.candidates import argmax, race_candidates, top_candidates
from worker.model.penalties import index_tensor, penalized
from worker.model.sampling_types import SamplerOutput, SamplingRow, TokenLogprobs
from worker.request import SamplingParams

__all__ = ["Sampler", "SamplerOutput", "SamplingRow", "TokenLogprobs"]

# Candidate widths tried, in order, for rows with top_k / top_p / min_p; then a full sort.
_CANDIDATE_WIDTHS = (64, 1024)
# Temperatures below this sample greedily, as in vLLM: 1 / T would overflow float32.
_MIN_TEMPERATURE = 1e-5
_MASK64 = (1 << 64) - 1


class Sampler:
    """Samples one token per row of a [N, V] logits tensor; see the module docstring.

    `seed` seeds the sampler's own generator, used by rows without a seed of their own.
    `row_argmax` (CPU: the C kernels' `argmax_rows`), where given, takes the argmax of
    contiguous float32 rows in place of the two-level torch one.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        seed: int = 0,
        row_argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.device = resolve_device(str(device))  # with its index, as tensors report it
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self._row_argmax = row_argmax

    def _argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, -1) of x [R, V]."""
        if (
            self._row_argmax is not None
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and x.is_contiguous()
        ):
            return self._row_argmax(x)
        return argmax(x)

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
            idx = index_tensor(ids, logits.device)
            group = [rows[i] for i in ids]
            if len(ids) == n:  # the caller's tensor: copied if anything is to change
                x = penalized(logits, group, shared=True)
            else:
                x = penalized(logits.index_select(0, idx), group, shared=False)
            # x: [len(ids), V] float32, read only from here on.
            tokens[idx] = self._argmax(x) if race is None else race(x, group)
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
            return self._argmax(q.div_(self._race_times(rows, x.shape[1], x.device)))
        out = torch.empty(len(rows), dtype=torch.int64, device=x.device)
        s_idx = index_tensor(seeded, x.device)
        plain = [j for j in range(len(rows)) if rows[j].params.seed is None]
        p_idx = index_tensor(plain, x.device)
        qs = q.index_select(0, s_idx)
        out[s_idx] = self._argmax(
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
            idx = index_tensor(ids, device)
            xs = x if len(ids) == len(rows) else x.index_select(0, idx)
            vals, cols = top_candidates(xs, width)  # [P, C] best first
            times = self._race_times([rows[i] for i in ids], vocab, device, cols)
            token, done = race_candidates(
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
            u[index_tensor(unseeded, device)] = torch.rand(
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


def _output(
    logits: torch.Tensor, rows: Sequence[SamplingRow], tokens: torch.Tensor
) -> SamplerOutput:
    """Logprobs from the raw logits; everything comes to the host in one transfer."""
    n = len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    n_top = min(max((rows[i].params.logprobs or 0 for i in want), default=0), logits.shape[1])
    parts = [tokens.double()]
    if want:
        idx = index_tensor(want, logits.device)
        lp = torch.log_softmax(logits.index_select(0, idx).float(), -1)  # [L, V]
        parts.append(lp.gather(1, tokens[idx][:, None])[:, 0].double())  # [L]
        if n_top:
            values, cols = top_candidates(lp, n_top)  # [L, n_top] best first
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


def greedy_only(params: SamplingParams, output_index: int) -> bool:
    """Whether a row's token is the plain argmax of its logits: greedy (whatever its seed
    or filters), without penalties, logprobs, or min_tokens still to reach (whose bans
    change the logits), so that the caller may pick it without the whole logits
    (LlamaForCausalLM.greedy_tokens)."""
    return (
        params.temperature < _MIN_TEMPERATURE
        and params.logprobs is None
        and not params.needs_penalties
        and output_index >= params.min_tokens
    )


def _inverse_temperatures(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    return torch.tensor([1.0 / r.params.temperature for r in rows], device=device)[:, None]


def _filters(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def _row_seed(seed: int, output_index: int) -> int:
    """A 64-bit generator seed from (seed, output_index) only (splitmix64 mixing)."""
    return _mix64(_mix64(seed & _MASK64) ^ output_index)


def _mix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)

"""Sampler: greedy, the seeded exponential race, filters, penalties, min_tokens, logprobs.

Distribution checks draw a few thousand tokens with fixed seeds and compare counts with
the target distribution (chi-square with a generous bound), and also check that the
same counts reject a wrong target, so each check can fail.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Sequence
from unittest import mock

import pytest
import torch

from worker.model import candidates as candidates_module
from worker.model import penalties as penalties_module
from worker.model import sampler as sampler_module
from worker.model.sampler import Sampler, SamplerOutput, SamplingRow
from worker.request import SamplingParams


def row(
    params: SamplingParams,
    output_index: int = 0,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    stop_ids: tuple[int, ...] = (),
) -> SamplingRow:
    return SamplingRow(params, output_index, prompt, output, stop_ids)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], seed: int = 0) -> SamplerOutput:
    return Sampler(seed=seed)(logits, rows)


def randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def chi2(counts: Counter[int], probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, bound): the bound is far in the tail of chi-square(df); bins with an
    expected count under 5 are pooled."""
    n = sum(counts.values())
    expected = (probs.double() * n).tolist()
    stat, pool_obs, pool_exp, bins = 0.0, 0.0, 0.0, 0
    for t, e in enumerate(expected):
        if e >= 5:
            stat += (counts.get(t, 0) - e) ** 2 / e
            bins += 1
        else:
            pool_obs += counts.get(t, 0)
            pool_exp += e
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / max(pool_exp, 1.0)
        bins += 1
    df = max(bins - 1, 1)
    return stat, df + 6 * math.sqrt(2 * df) + 10


def assert_matches(counts: Counter[int], target: torch.Tensor, wrong: torch.Tensor) -> None:
    stat, bound = chi2(counts, target)
    assert stat < bound, f"chi-square {stat:.1f} >= {bound:.1f}"
    stat_wrong, bound_wrong = chi2(counts, wrong)
    assert stat_wrong > bound_wrong, "the check cannot tell the target from a wrong one"


def reference_kept(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Renormalised probabilities after temperature, top_k, top_p, min_p: plain sort/cumsum."""
    z = x.double() / p.temperature
    vocab = z.numel()
    if 0 < p.top_k < vocab:
        kth = z.sort(descending=True).values[p.top_k - 1]
        z = torch.where(z >= kth, z, -math.inf)
    probs = torch.softmax(z, -1)
    if p.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < p.top_p
        keep = torch.zeros(vocab, dtype=torch.bool).scatter_(0, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


# --- greedy ------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 7, 255, 256, 1000, 4099])
def test_greedy_is_argmax(vocab: int) -> None:
    logits = randn(9, vocab, seed=vocab)
    out = sample(logits, [row(SamplingParams(temperature=0))] * 9)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 9


@pytest.mark.parametrize("vocab", [300, 1000, 4099])
def test_greedy_ties_pick_the_first_index(vocab: int) -> None:
    logits = torch.zeros(4, vocab)
    logits[0, [5, vocab // 2, vocab - 1]] = 3.0  # ties in different blocks
    logits[1, [vocab - 2, vocab - 1]] = 2.0  # ties in the short tail block
    logits[2, :] = -math.inf
    logits[2, [vocab - 1, 17]] = 0.5
    # row 3: all equal -> 0
    rows = [row(SamplingParams(temperature=0))] * 4
    first = sample(logits, rows).token_ids
    assert first == [5, vocab - 2, 17, 0]
    assert sample(logits, rows).token_ids == first


def test_tiny_temperature_is_greedy() -> None:
    logits = randn(4, 5000, seed=2)
    rows = [row(SamplingParams(temperature=t, seed=1)) for t in (1e-7, 1e-30, 1e-300, 5e-6)]
    assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_greedy_applies_penalties_and_bans_before_argmax() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0]])
    # token 0 repeated: 5 / 2 = 2.5 < 4 -> token 1 wins; token 1 is banned -> token 2.
    p = SamplingParams(temperature=0, repetition_penalty=2.0, min_tokens=3)
    out = sample(logits, [row(p, output_index=1, output=[0], stop_ids=(1,))])
    assert out.token_ids == [2]
    assert logits.tolist() == [[5.0, 4.0, 3.0, -1.0]]  # the caller's tensor is left alone


# --- seeded rows: the same choice whatever the batch ---------------------------------


SEEDED = [
    SamplingParams(seed=7),  # the race over the whole vocabulary
    SamplingParams(seed=7, temperature=0.7, top_p=0.9),
    SamplingParams(seed=7, top_k=20, min_p=0.05),
    SamplingParams(seed=7, temperature=1.3, top_p=0.995),  # nucleus past the candidates
    SamplingParams(seed=7, presence_penalty=1.5, top_p=0.8),
]


@pytest.mark.parametrize("params", SEEDED)
def test_seeded_row_ignores_batch_position_and_sampler(params: SamplingParams) -> None:
    vocab = 3000
    target = randn(vocab, seed=1, scale=2.0)
    me = row(params, output_index=4, prompt=[1, 2, 3], output=[9, 9, 10])
    alone = Sampler(seed=0)(target[None], [me]).token_ids[0]

    others = [
        row(SamplingParams(temperature=0)),
        row(SamplingParams(top_p=0.5)),
        row(SamplingParams(seed=99, top_k=3)),
        row(SamplingParams(temperature=0.5), output=[1, 1]),
        row(SamplingParams(frequency_penalty=1.0, min_p=0.1), output=[2]),
    ]
    for position in (0, 2, 5):
        batch = [*others[:position], me, *others[position:]]
        logits = randn(len(batch), vocab, seed=position + 10, scale=3.0)
        logits[position] = target
        for engine_seed in (0, 1234):
            out = Sampler(seed=engine_seed)(logits, batch)
            assert out.token_ids[position] == alone


def test_seeded_rows_are_not_all_the_same_choice() -> None:
    # Guards the test above: with flat logits, seeds and steps give different tokens.
    logits = torch.zeros(1, 1000)
    by_seed = {sample(logits, [row(SamplingParams(seed=s))]).token_ids[0] for s in range(20)}
    by_step = {
        sample(logits, [row(SamplingParams(seed=3), output_index=i)]).token_ids[0]
        for i in range(20)
    }
    assert len(by_seed) > 15
    assert len(by_step) > 15


def test_seeded_draws_are_independent_across_output_index() -> None:
    # One seed, 3000 steps over 12 equally likely tokens: the sequence must look
    # uniform and consecutive tokens uncorrelated (pairs uniform over 144 cells).
    vocab, steps = 12, 3000
    rows = [row(SamplingParams(seed=5), output_index=i) for i in range(steps)]
    tokens = sample(torch.zeros(steps, vocab), rows).token_ids
    uniform = torch.full((vocab,), 1 / vocab)
    assert_matches(Counter(tokens), uniform, torch.softmax(torch.arange(vocab) / 4.0, -1))
    pairs = Counter(a * vocab + b for a, b in itertools.pairwise(tokens))
    stat, bound = chi2(pairs, torch.full((vocab * vocab,), 1 / vocab**2))
    assert stat < bound
    assert sum(a == b for a, b in itertools.pairwise(tokens)) < 2 * steps / vocab


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = torch.zeros(50, 500)
    rows = [row(SamplingParams(top_p=0.9))] * 25 + [row(SamplingParams())] * 25
    a = Sampler(seed=1)(logits, rows).token_ids
    assert Sampler(seed=1)(logits, rows).token_ids == a
    assert Sampler(seed=2)(logits, rows).token_ids != a


# --- distributions ---------------------------------------------------------------------


@pytest.mark.parametrize("seeded", [True, False])
def test_race_matches_softmax_with_temperature(seeded: bool) -> None:
    n, temperature = 4000, 0.7
    x = torch.tensor([1.0, 0.5, 0.0, -0.3, 2.0, -1.0, 0.2, 1.1, -2.0, 0.7])
    p = [SamplingParams(temperature=temperature, seed=s if seeded else None) for s in range(n)]
    tokens = sample(x.expand(n, -1), [row(q) for q in p]).token_ids
    assert_matches(Counter(tokens), torch.softmax(x / temperature, -1), torch.softmax(x, -1))


FILTERS = [
    SamplingParams(temperature=0.8, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=1.5, min_p=0.2),
    SamplingParams(temperature=1.2, top_k=6, top_p=0.8, min_p=0.1),
]


@pytest.mark.parametrize("params", FILTERS)
@pytest.mark.parametrize("vocab", [16, 9000])  # 9000: the candidates come from blocks
def test_filters_keep_the_reference_set_and_its_distribution(
    params: SamplingParams, vocab: int
) -> None:
    n = 2000
    x = torch.full((vocab,), -12.0)  # a background too light to matter
    head = [3.0, 2.6, 2.5, 2.0, 1.8, 1.7, 1.2, 1.0, 0.9, 0.5, 0.3, 0.1, 0.0, -1.0, -2.0, -3.0]
    x[:16] = torch.tensor(head)
    x = x[torch.randperm(vocab, generator=torch.Generator().manual_seed(vocab))]
    target = reference_kept(x, params)
    assert 2 < int((target > 0).sum()) < 16  # the filter matters
    # Seeded rows (their own generators) on the small vocabulary, the batched draw on the big one.
    seeds = range(n) if vocab == 16 else [None] * n
    rows = [row(dataclasses.replace(params, seed=s)) for s in seeds]
    tokens = sample(x.expand(n, -1), rows).token_ids
    assert all(target[t] > 0 for t in tokens)
    unfiltered = torch.softmax(x / params.temperature, -1)
    assert_matches(Counter(tokens), target, unfiltered)


def test_top_p_nucleus_past_every_candidate_width() -> None:
    # 2000 near-equal tokens and 1000 lower ones: the nucleus (~2360 tokens) is wider
    # than every candidate width, so the rows settle only after the full sort.
    vocab, n = 3000, 400
    x = torch.cat([torch.zeros(2000), torch.full((1000,), -1.0)]) + randn(vocab, scale=1e-3)
    params = SamplingParams(top_p=0.9)
    target = reference_kept(x, params)
    assert int((target > 0).sum()) > 2000
    tokens = Sampler()(x.expand(n, -1), [row(params)] * n).token_ids
    assert all(target[t] > 0 for t in tokens)
    high = sum(t < 2000 for t in tokens)
    mass_high = float(target[:2000].sum())  # ~0.94
    assert abs(high / n - mass_high) < 5 * math.sqrt(mass_high * (1 - mass_high) / n)


def test_candidate_paths_agree_with_the_full_sort() -> None:
    # Seeded rows take their race times by token id, so the candidate paths (64, 1024,
    # then a full sort) must pick exactly what a full sort alone picks.
    vocab, n = 9000, 60
    logits = randn(n, vocab, seed=3, scale=1.0) * torch.linspace(0.5, 6.0, n)[:, None]
    grid = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.5, temperature=0.5),
        SamplingParams(top_k=50),
        SamplingParams(top_k=1500, temperature=2.0),
        SamplingParams(top_k=2000, top_p=0.95),
        SamplingParams(min_p=0.05),
        SamplingParams(top_k=100, min_p=0.3, top_p=0.99),
    ]
    rows = [row(dataclasses.replace(grid[i % len(grid)], seed=i), output_index=i) for i in range(n)]
    fast = sample(logits, rows).token_ids
    with mock.patch.object(sampler_module, "_CANDIDATE_WIDTHS", ()):
        assert sample(logits, rows).token_ids == fast
    for i, t in enumerate(fast):
        assert reference_kept(logits[i], rows[i].params)[t] > 0


def test_top_p_sees_the_distribution_left_by_top_k() -> None:
    # 30 strong tokens hold half the mass, 8970 weak ones the other half. top_k=1100
    # leaves the strong ones ~89% of the mass, so the 0.45 nucleus is about half of them
    # (with the whole row's normaliser it would be nearly all 30).
    vocab, n = 9000, 300
    x = torch.cat([5.7 + torch.linspace(0.3, -0.3, 30), randn(vocab - 30, scale=1e-3)])
    params = SamplingParams(top_k=1100, top_p=0.45)
    target = reference_kept(x, params)
    assert 5 < int((target > 0).sum()) < 20
    rows = [row(dataclasses.replace(params, seed=s)) for s in range(n)]
    tokens = sample(x.expand(n, -1), rows).token_ids
    assert all(target[t] > 0 for t in tokens)


@pytest.mark.parametrize("vocab", [100, 8192, 9001])
def test_top_candidates_are_the_topk(vocab: int) -> None:
    x = randn(5, vocab, seed=vocab)
    x[1, :] = -math.inf
    x[1, :3] = 1.0  # fewer finite entries than the width
    x[2] = x[2].round()  # many ties
    x[3, -3:] = 10.0  # the best entries in the last columns
    for width in (1, 64, 1024):
        if width >= vocab:
            continue
        vals, cols = candidates_module.top_candidates(x, width)
        assert torch.equal(vals, x.topk(width, -1).values)
        assert int(cols.min()) >= 0 and int(cols.max()) < vocab
        assert torch.equal(x.gather(1, cols), vals)
        assert all(len(set(c.tolist())) == width for c in cols)  # no token twice


def test_greedy_pick_is_the_argmax_of_the_rescored_rows() -> None:
    """candidates.greedy_pick against torch.argmax over the widened rows with the exact
    scores written over their candidates: rows decided by their candidates (ties among
    them: the lowest column), and rows whose candidates all scored down to the k-th
    narrow value or under, which must take their whole row (a column outside the
    candidates, equal to the floor and before them, wins the tie there)."""
    g = torch.Generator().manual_seed(31)
    S, V, k = 12, 3000, 16
    narrow = (torch.randn(S, V, generator=g) * 3).bfloat16()
    cols = narrow.float().sort(dim=-1, descending=True, stable=True).indices[:, :k]
    exact = narrow.float().gather(1, cols) + torch.randn(S, k, generator=g) * 0.01
    floor = narrow.float().gather(1, cols[:, -1:])  # [S, 1]
    exact[1, 3] = exact[1, 7] = exact[1].max() + 1.0  # a tie among the candidates
    exact[2] = floor[2] - 1.0  # all scored under the floor: another column wins
    exact[3] = floor[3]  # at the floor: a column outside with the same value may come first
    narrow[3, 0] = narrow[3, cols[3, -1]]
    exact[4] = floor[4] - 0.5
    exact[4, 5] = floor[4] + 0.5  # one still above the floor
    exact[5, 2] = math.nan  # a NaN among the candidates: torch's argmax of the whole row
    want = narrow.float().scatter(1, cols, exact).argmax(-1)
    got = candidates_module.greedy_pick(narrow, cols, exact)
    assert torch.equal(got, want)
    assert got[1] == min(cols[1, 3], cols[1, 7])
    assert int(got[2]) not in cols[2].tolist()
    assert got[3] == 0 and got[4] == cols[4, 5] and got[5] == cols[5, 2]
    # the candidates in any order: the floor is the lowest of them
    shuffled = torch.randperm(k, generator=g)
    assert torch.equal(
        candidates_module.greedy_pick(narrow, cols[:, shuffled], exact[:, shuffled]), want
    )


def test_greedy_only_is_for_rows_whose_pick_is_the_argmax() -> None:
    """Greedy rows, whatever their seed or filters, pick the argmax; penalties, logprobs
    and min_tokens still to reach (bans) change the logits or need them."""
    greedy = SamplingParams(temperature=0.0)
    for same in (
        greedy,
        SamplingParams(temperature=1e-6),
        dataclasses.replace(greedy, seed=1, top_k=5, top_p=0.5, min_p=0.1),
    ):
        assert sampler_module.greedy_only(same, 0)
        assert sample(randn(2, 50, seed=4), [row(same)] * 2).token_ids == (
            randn(2, 50, seed=4).argmax(-1).tolist()
        )
    for other in (
        SamplingParams(temperature=0.7),
        dataclasses.replace(greedy, logprobs=0),
        dataclasses.replace(greedy, repetition_penalty=1.2),
        dataclasses.replace(greedy, frequency_penalty=0.5),
        dataclasses.replace(greedy, presence_penalty=0.5),
        dataclasses.replace(greedy, min_tokens=2),
    ):
        assert not sampler_module.greedy_only(other, 0)
    assert sampler_module.greedy_only(dataclasses.replace(greedy, min_tokens=2), 2)  # reached


# --- penalties and min_tokens ------------------------------------------------------------


def reference_penalties(x: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    y = x.double().clone()
    p = r.params
    for t in set(r.prompt_token_ids) | set(r.output_token_ids):
        y[t] = y[t] / p.repetition_penalty if y[t] > 0 else y[t] * p.repetition_penalty
    for t, c in Counter(r.output_token_ids).items():
        y[t] -= p.frequency_penalty * c + p.presence_penalty
    return y


def test_penalties_match_a_per_row_reference() -> None:
    vocab = 50
    logits = randn(5, vocab, seed=4, scale=3.0)
    rows = [
        row(SamplingParams(repetition_penalty=1.3), prompt=[1, 2, 2, 40], output=[3, 1, 3]),
        row(SamplingParams(frequency_penalty=0.7), prompt=[4], output=[5, 5, 5, 6]),
        row(SamplingParams(presence_penalty=-0.5), prompt=[7], output=[8, 8, 9]),
        row(
            SamplingParams(repetition_penalty=0.8, frequency_penalty=0.3, presence_penalty=1.1),
            prompt=[10, 11, 49],
            output=[11, 12, 12, 0],
        ),
        row(SamplingParams(), prompt=[1, 2], output=[3]),  # no penalties: untouched
    ]
    before = logits.clone()
    got = penalties_module.penalized(logits, rows, shared=True)
    assert torch.equal(logits, before)
    for i, r in enumerate(rows):
        ref = reference_penalties(logits[i], r)
        torch.testing.assert_close(got[i].double(), ref, rtol=1e-6, atol=1e-6)
    # The rows differ from the raw logits exactly where the reference says.
    changed = (got != logits).nonzero().tolist()
    assert [0, 40] in changed and [1, 5] in changed and [3, 49] in changed
    assert not (got[4] != logits[4]).any()


def test_penalties_reject_token_ids_outside_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="token ids"):
        sample(torch.zeros(1, 10), [row(SamplingParams(presence_penalty=1.0), output=[10])])


def test_min_tokens_bans_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 10.0, 9.5, 1.0, 9.0]])  # EOS 1, stop id 2 best
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(2,))
    banned = (1, 2, 99)  # 99 is outside the logits: ignored
    for i in range(5):
        token = sample(logits, [row(p, output_index=i, stop_ids=banned)]).token_ids[0]
        assert token == (4 if i < 3 else 1)
    # Random rows too: 200 seeded draws over near-equal logits never hit a banned id.
    flat = torch.zeros(200, 5)
    rows = [row(SamplingParams(seed=s, min_tokens=1), stop_ids=(0, 3)) for s in range(200)]
    tokens = sample(flat, rows).token_ids
    assert set(tokens) == {1, 2, 4}


# --- logprobs, dtypes, errors --------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits() -> None:
    vocab = 300
    logits = randn(3, vocab, seed=8, scale=2.0)
    raw = torch.log_softmax(logits, -1)
    best = int(logits[0].argmax())
    rows = [
        # greedy, best token banned: the sampled token is not in the top 1
        row(SamplingParams(temperature=0, min_tokens=1, logprobs=1), stop_ids=(best,)),
        row(
            SamplingParams(temperature=2.0, top_p=0.5, repetition_penalty=1.5, logprobs=5),
            output=[1],
        ),
        row(SamplingParams(logprobs=0)),
    ]
    out = sample(logits, rows)
    for i, (t, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert lp is not None and lp.token_id == t
        assert lp.logprob == pytest.approx(raw[i, t].item(), abs=1e-5)
        assert len(lp.top) == rows[i].params.logprobs
        ref = raw[i].topk(len(lp.top)) if lp.top else None
        if ref is not None:
            assert [tid for tid, _ in lp.top] == ref.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(ref.values.tolist(), abs=1e-5)
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    assert out.token_ids[0] != best
    assert out.logprobs[0] is not None and out.logprobs[0].top[0][0] == best


def test_bfloat16_logits() -> None:
    logits = randn(6, 5000, seed=9, scale=3.0).bfloat16()
    rows = [
        row(SamplingParams(temperature=0, logprobs=2)),
        row(SamplingParams(temperature=0, repetition_penalty=1.2), output=[0]),
        row(SamplingParams(seed=1)),
        row(SamplingParams(top_p=0.9, seed=2, logprobs=0)),
        row(SamplingParams(top_k=5)),
        row(SamplingParams(min_p=0.1, min_tokens=2), stop_ids=(3,)),
    ]
    out = sample(logits, rows)
    as_float = sample(logits.float(), rows)
    assert out.token_ids[0] == logits[0].float().argmax().item()
    assert out.token_ids[:4] == as_float.token_ids[:4]
    lp = out.logprobs[0]
    assert lp is not None
    best_logprob = torch.log_softmax(logits[0].float(), -1).max().item()
    assert lp.logprob == pytest.approx(best_logprob, abs=1e-5)
    assert all(0 <= t < 5000 for t in out.token_ids)


def test_empty_batch() -> None:
    assert sample(torch.zeros(0, 10), []) == SamplerOutput(token_ids=[], logprobs=[])


@pytest.mark.parametrize(
    ("logits", "n_rows"),
    [
        (torch.zeros(10), 1),
        (torch.zeros(1, 2, 10), 1),
        (torch.zeros(2, 10), 3),
        (torch.zeros(2, 10, dtype=torch.int64), 2),
        (torch.zeros(1, 0), 1),
    ],
)
def test_invalid_input(logits: torch.Tensor, n_rows: int) -> None:
    with pytest.raises(ValueError):
        sample(logits, [row(SamplingParams())] * n_rows)


def test_mixed_seeded_and_unseeded_rows() -> None:
    """In one batch, seeded rows keep their own draws and unseeded rows still follow
    the softmax (the two use different sampling paths)."""
    n, temperature = 3000, 0.6
    x = torch.tensor([0.3, 1.2, -0.5, 0.8, 0.0, -1.5])
    seeded = [SamplingParams(temperature=temperature, seed=s) for s in range(8)]
    alone = sample(x.expand(8, -1), [row(q) for q in seeded]).token_ids
    params = [SamplingParams(temperature=temperature) for _ in range(n)]
    mixed = seeded[:4] + params + seeded[4:]
    tokens = sample(x.expand(len(mixed), -1), [row(q) for q in mixed]).token_ids
    assert tokens[:4] + tokens[-4:] == alone
    assert_matches(Counter(tokens[4:-4]), torch.softmax(x / temperature, -1), torch.softmax(x, -1))

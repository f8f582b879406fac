"""The clique argument of the wave bound (`pricing.clique_bound`): prompt groups that cannot
share a wave whole force prompts to be paid again. The bound it raises stays at or below the
fewest waves of any plan under exact prices (brute force over set partitions)."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from search_fakes import LAYOUT_MODELS, layout_model

from waveplan.pricing.clique_bound import find_cliques, greedy_clique
from waveplan.pricing.step import Request, Step
from waveplan.pricing.wave_pricer import WavePricer, _wave_bound

MODELS = [layout_model(p, **kw) for p, kw in LAYOUT_MODELS]


def _partitions(n: int):
    """Every set partition of range(n), as label lists (restricted growth strings)."""
    labels = [0] * n

    def rec(i: int, top: int):
        if i == n:
            yield list(labels)
            return
        for v in range(top + 2):
            labels[i] = v
            yield from rec(i + 1, max(top, v))

    if n:
        yield from rec(1, 0)


def _brute_force_waves(pricer: WavePricer, budget: int) -> int:
    """Fewest flat waves of any plan within the budget, each gradient slot's pending
    gradients carried by some wave holding its gradient requests (exact prices)."""
    n = len(pricer.step.requests)
    slot_of = [pricer.class_slot[k] if pricer.class_grad[k] else None for k in pricer.class_of]
    slots = sorted({s for s in slot_of if s is not None})
    cache: dict = {}

    def fits(wave: tuple, first: frozenset) -> bool:
        key = (wave, first)
        if key not in cache:
            cache[key] = pricer.admitted([np.asarray(wave, dtype=np.int64)],
                                         first_slots=first) <= budget
        return cache[key]

    best = n + 1
    for labels in _partitions(n):
        k = max(labels) + 1
        if k >= best:
            continue
        waves = [tuple(i for i in range(n) if labels[i] == w) for w in range(k)]
        if not all(fits(w, frozenset()) for w in waves):
            continue
        options = [[w for w, wave in enumerate(waves) if any(slot_of[i] == s for i in wave)]
                   for s in slots]
        for carriers in itertools.product(*options):
            first = [frozenset(s for s, c in zip(slots, carriers, strict=True) if c == w)
                     for w in range(k)]
            if all(fits(wave, f) for wave, f in zip(waves, first, strict=True)):
                best = k
                break
    return best


def _plain_bound(pricer: WavePricer, budget: int) -> int:
    """The bound without the clique argument."""
    lower = pricer._cached_envelope(lower=True)
    fe = float(pricer.model.charges.first_exec) * pricer.model.safety
    grad = np.asarray(pricer.class_grad, dtype=bool)
    return int(min(_wave_bound(lower.coef, lower.presence, lower.pending, pricer.class_totals(),
                               grad, float(budget), fe, np.zeros(lower.presence.shape[0])),
                   len(pricer.step.requests)))


def _length_step(groups, slots, grads) -> Step:
    """groups: (prompt rows, [completion rows]); a prompt of 0 rows is no key."""
    reqs = []
    for g, (pre, members) in enumerate(groups):
        for m, own in enumerate(members):
            reqs.append(Request(id=f"g{g}r{m}", num_tokens=pre + own,
                                prompt=f"p{g}" if pre else None, num_prompt_tokens=pre,
                                slot=slots[g], grad=grads[g]))
    return Step.from_requests(reqs)


def _token_step(system: int, groups, slots, grads, seed: int) -> Step:
    """A shared system prompt of `system` tokens, then per group its prompt, then each
    member's completion (token form: the groups nest inside the system prompt)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 1000, size=system).tolist()
    reqs = []
    for g, (pre, members) in enumerate(groups):
        prompt = [1000 + g] + rng.integers(0, 1000, size=max(pre - 1, 0)).tolist()
        for m, own in enumerate(members):
            tokens = base + prompt + [2000 + m] + rng.integers(0, 1000, size=own).tolist()
            reqs.append(Request.from_tokens(f"g{g}r{m}", np.asarray(tokens, dtype=np.int64),
                                            slot=slots[g], grad=grads[g]))
    return Step.from_requests(reqs)


@st.composite
def _steps(draw):
    k = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 3)) for _ in range(k)]
    while sum(sizes) > 7:
        sizes[sizes.index(max(sizes))] -= 1
    groups = [(draw(st.integers(0, 3000)), [draw(st.integers(1, 600)) for _ in range(c)])
              for c in sizes]
    slots = [draw(st.sampled_from(("a", "b"))) for _ in groups]
    grads = [draw(st.booleans()) or draw(st.booleans()) for _ in groups]
    if draw(st.booleans()):
        return _length_step(groups, slots, grads)
    groups = [(max(pre, 1), members) for pre, members in groups]
    return _token_step(draw(st.integers(0, 1500)), groups, slots, grads,
                       draw(st.integers(0, 10**6)))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(MODELS), step=_steps(), factor=st.floats(1.0, 3.0))
def test_clique_bound_never_exceeds_the_optimum(model, step, factor):
    """Shared prompts (length form, and token form nested in a shared system prompt): the
    raised bound is <= the brute-force optimum under exact prices, and >= the plain one."""
    pricer = WavePricer.build(step, model)
    budget = int(factor * max(pricer.admitted([np.asarray([i])], first_slots=frozenset(
        {r.slot} if r.grad else ())) for i, r in enumerate(step.requests)))
    bound = pricer.lower_bound_waves(budget)
    assert _plain_bound(pricer, budget) <= bound <= _brute_force_waves(pricer, budget)


def _pairs_step() -> tuple[Step, WavePricer, int]:
    """Four groups of two requests behind long prompts, priced so that no two groups fit one
    wave whole, while the total mass alone allows fewer waves than groups."""
    model = layout_model("qwen3-8b")
    step = _length_step([(3000, [100, 120])] * 4, ["a"] * 4, [True] * 4)
    pricer = WavePricer.build(step, model)
    one = pricer.admitted([np.asarray([0, 1])], first_slots=frozenset({"a"}))
    return step, pricer, int(one * 1.3)


def test_clique_raises_the_bound_to_the_optimum():
    """Four groups that pairwise cannot share a wave: the plain bound is below the optimum;
    the clique of four forces splits that pay the 3000-row prompt again, and the raised bound
    meets the brute-force optimum."""
    step, pricer, budget = _pairs_step()
    lower = pricer._cached_envelope(lower=True)
    fe = float(pricer.model.charges.first_exec) * pricer.model.safety
    cliques = find_cliques(step, pricer.class_of, np.arange(8), lower.coef, lower.presence,
                           np.asarray(pricer.class_grad), float(budget), fe)
    assert cliques.size == 4 and cliques.forced.shape[0] == 0
    plain = _plain_bound(pricer, budget)
    best = _brute_force_waves(pricer, budget)
    assert plain < best
    assert pricer.lower_bound_waves(budget) == best


def test_clique_extra_counts_the_cheapest_splits():
    """With N waves a clique of c pays the c - N smallest excesses at each point; a clique of
    unsplittable groups larger than N makes N impossible."""
    step, pricer, budget = _pairs_step()
    lower = pricer._cached_envelope(lower=True)
    cliques = find_cliques(step, pricer.class_of, np.arange(8), lower.coef, lower.presence,
                           np.asarray(pricer.class_grad), float(budget), 0.0)
    assert cliques.size == 4
    ok, extra = cliques.extra(4)
    assert ok and not extra.any()
    ok, extra = cliques.extra(2)
    assert ok and np.allclose(extra, np.sort(cliques.clique, axis=0)[:2].sum(axis=0))
    single = _length_step([(0, [3000])] * 4, ["a"] * 4, [True] * 4)
    sp = WavePricer.build(single, layout_model("qwen3-8b"))
    cap = int(sp.admitted([np.asarray([0])], first_slots=frozenset({"a"})) * 1.5)
    sl = sp._cached_envelope(lower=True)
    cl = find_cliques(single, sp.class_of, np.arange(4), sl.coef, sl.presence,
                      np.asarray(sp.class_grad), float(cap), 0.0)
    assert cl.size == 4
    assert cl.extra(4)[0] and not cl.extra(3)[0]
    assert sp.lower_bound_waves(cap) == 4


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 12), seed=st.integers(0, 10**6), p=st.floats(0.0, 1.0))
def test_greedy_clique_is_a_maximal_clique(n, seed, p):
    """The greedy returns a clique (pairwise adjacent) that no vertex extends, the same one
    on every call."""
    rng = np.random.default_rng(seed)
    adj = rng.random((n, n)) < p
    adj = np.triu(adj, 1)
    adj = adj | adj.T
    clique = greedy_clique(adj)
    assert np.array_equal(clique, greedy_clique(adj.copy()))
    if n == 0:
        assert len(clique) == 0
        return
    assert len(set(clique.tolist())) == len(clique) >= 1
    for a, b in itertools.combinations(clique.tolist(), 2):
        assert adj[a, b]
    outside = np.setdiff1d(np.arange(n), clique)
    assert not any(adj[v, clique].all() for v in outside)

"""Invariants under random input (issue 7, item 3), as hypothesis properties.

Over random steps (prefix groups with shared prompts, token and length forms, lengths 1..16k,
gradient and no-gradient requests, several LoRA slots), geometries (the bundled presets
through `Planner.from_preset`, small custom decoders through `Planner(geometry=...)`), parallel
layouts (valid and invalid TP/CP/PP/EP/SP), budgets (one byte to 1 PiB, per-rank lists, and
invalid ones), every packer, atomic units and `num_waves`:

* a layout is refused with a `ConfigError` naming the `parallel.*` field exactly when it
  breaks a documented rule (`ParallelLayout`, `ParallelLayout.validate_for`);
* every plan passes the shared invariant checker `waveplan.search.check_plan`;
* planning is deterministic: the same inputs planned again (by a fresh planner) with
  `deterministic=True` give the same plan JSON except `planning_ms`;
* nothing raises but a documented `WaveplanError`, and only the one the input calls for:
  `ConfigError` for a bad budget, an unknown LoRA slot or `num_waves` with a baseline packer,
  `StepError` for bad atomic units, `InfeasibleError` only where a plan may not exist; with a
  budget at which every request fits alone (no atomic units, no `num_waves`) planning must
  succeed.

Derandomized and database-free, so that CI sees the same examples on every run.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from waveplan.planner import Planner
from waveplan.pricing import rope_cache
from waveplan.pricing.errors import ConfigError, InfeasibleError, StepError, WaveplanError
from waveplan.pricing.geometry import AttentionSpec, GdnSpec, LayerSpec, ModelGeometry, MoeSpec
from waveplan.pricing.lora import ALL_TARGETS, LoraConfig, LoraSlot
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.presets import list_presets, load_preset
from waveplan.pricing.step import Request, Step
from waveplan.search import PackerKind, check_plan

GIB = 2**30
PIB = 2**50  # the planner's largest budget
PRESETS = tuple(list_presets())
SLOTS = ("default", "b", "c")
BASELINES = {PackerKind.FFD, PackerKind.KK, PackerKind.UNIFORM_WIDTH}

RANDOM = dict(deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --- geometries and layouts ----------------------------------------------------------------


@st.composite
def custom_geometries(draw) -> ModelGeometry:
    """A small decoder: 1..6 layers of attention or GDN mixers and dense or MoE MLPs; some
    head counts (3, 6) that TP 2 or 4 cannot split."""
    n = draw(st.integers(1, 6))
    mixers = draw(st.lists(st.sampled_from(("attention", "gdn")), min_size=n, max_size=n))
    mlps = draw(st.lists(st.sampled_from(("dense", "moe")), min_size=n, max_size=n))
    attention = gdn = moe = None
    if "attention" in mixers:
        heads = draw(st.sampled_from((1, 2, 3, 4, 6, 8)))
        attention = AttentionSpec(heads, draw(st.sampled_from(_divisors(heads))),
                                  draw(st.sampled_from((16, 32, 64))), output_gate=draw(st.booleans()))
    if "gdn" in mixers:
        keys = draw(st.sampled_from((1, 2, 4, 6)))
        gdn = GdnSpec(keys, keys * draw(st.sampled_from((1, 2))), draw(st.sampled_from((16, 32))),
                      draw(st.sampled_from((16, 32))), draw(st.integers(2, 4)))
    if "moe" in mlps:
        experts = draw(st.sampled_from((1, 2, 4, 8)))
        moe = MoeSpec(experts, draw(st.integers(1, experts)), draw(st.sampled_from((32, 128))),
                      draw(st.sampled_from((0, 64))))
    ffn = draw(st.sampled_from((96, 256, 768))) if "dense" in mlps else 0
    return ModelGeometry(name="custom", hidden=draw(st.sampled_from((64, 128, 256, 512))), ffn=ffn,
                         vocab=draw(st.integers(50, 4096)),
                         layers=tuple(LayerSpec(m, f) for m, f in zip(mixers, mlps, strict=True)),
                         attention=attention, gdn=gdn, moe=moe,
                         dtype=draw(st.sampled_from(("bf16", "fp16", "fp32"))),
                         gated_mlp=draw(st.booleans()), tied_embeddings=draw(st.booleans()))


geometries = st.one_of(st.sampled_from(PRESETS), custom_geometries())  # a preset name or a geometry


def _geometry(g) -> ModelGeometry:
    return load_preset(g) if isinstance(g, str) else g


def layout_problems(geometry: ModelGeometry, tp, cp, pp, ep, sp) -> set[str]:
    """The documented layout rules, restated: the fields that make the layout invalid."""
    sizes = {"tp": tp, "cp": cp, "pp": pp, "ep": ep}
    bad = {f"parallel.{k}" for k, v in sizes.items() if v <= 0}
    if bad:
        return bad
    if sp and tp == 1:
        bad.add("parallel.sequence_parallel")
    att, gdn, moe = geometry.attention, geometry.gdn, geometry.moe
    if att is not None and (att.num_heads % tp or att.num_kv_groups % tp):
        bad.add("parallel.tp")
    if gdn is not None and (gdn.num_key_heads % tp or gdn.num_value_heads % tp):
        bad.add("parallel.tp")
    if geometry.ffn and geometry.ffn % tp:
        bad.add("parallel.tp")
    if moe is not None and moe.num_experts % ep:
        bad.add("parallel.ep")
    if moe is not None and moe.expert_ffn % tp:   # the expert TP size defaults to TP
        bad.add("parallel.tp")
    if pp > geometry.num_layers:
        bad.add("parallel.pp")
    return bad


@st.composite
def layouts(draw, geometry: ModelGeometry, *, valid_share: float = 0.85):
    """(tp, cp, pp, ep, sp): mostly valid for `geometry`, else anything (zero and negative
    sizes, TP not dividing the heads, EP not dividing the experts, PP over the layers)."""
    if draw(st.sampled_from(range(100))) < 100 * valid_share:
        tps = [t for t in (1, 2, 4, 8) if not layout_problems(geometry, t, 1, 1, 1, False)]
        tp = draw(st.sampled_from(tps))
        eps = [e for e in (1, 2, 4, 8) if not layout_problems(geometry, 1, 1, 1, e, False)]
        return (tp, draw(st.sampled_from((1, 2, 4))),
                draw(st.integers(1, min(4, geometry.num_layers))), draw(st.sampled_from(eps)),
                tp > 1 and draw(st.booleans()))
    size = st.sampled_from((-1, 0, 1, 2, 3, 4, 8))
    return draw(size), draw(size), draw(size), draw(size), draw(st.booleans())


@st.composite
def lora_configs(draw, geometry: ModelGeometry, slots: list[str]) -> LoraConfig:
    return LoraConfig(grad_bytes=draw(st.sampled_from((2, 4))), slots=tuple(
        LoraSlot(name=s, rank=draw(st.sampled_from((1, 8, 16, 64))),
                 targets=tuple(draw(st.lists(st.sampled_from(ALL_TARGETS), unique=True, max_size=6)))
                 if draw(st.booleans()) else ALL_TARGETS,
                 layers=None if draw(st.booleans()) else tuple(draw(st.lists(
                     st.integers(0, geometry.num_layers - 1), max_size=geometry.num_layers))))
        for s in slots))


@st.composite
def planner_args(draw, geometry_choice, layout, slots: list[str]) -> dict:
    """The keyword arguments of a planner (one LoRA slot per name in `slots`)."""
    geometry = _geometry(geometry_choice)
    tp, cp, pp, ep, sp = layout
    return dict(geometry=geometry_choice, tp=tp, cp=cp, pp=pp, ep=ep, sp=sp,
                recompute=Recompute(mode=draw(st.sampled_from(("full", "full", "selective", "none"))),
                                    method=draw(st.sampled_from(("uniform", "block"))),
                                    num_layers=draw(st.integers(1, 2))),
                lora=draw(lora_configs(geometry, slots)),
                backend=draw(st.sampled_from(("te-gpu", "torch-cpu"))),
                head=draw(st.sampled_from(("chunked:512", "chunked:64", "full-native", "full-te"))),
                safety=draw(st.sampled_from((1.0, 1.05, 1.3))))


def make_planner(args: dict) -> Planner:
    """The preset path through `Planner.from_preset`, custom geometries through `Planner`."""
    g = args["geometry"]
    common = dict(recompute=args["recompute"], lora=args["lora"], backend=args["backend"],
                  head=args["head"], safety=args["safety"])
    if isinstance(g, str):
        return Planner.from_preset(g, tp=args["tp"], cp=args["cp"], pp=args["pp"], ep=args["ep"],
                                   sequence_parallel=args["sp"], **common)
    return Planner(geometry=g, parallel=ParallelLayout(tp=args["tp"], cp=args["cp"], pp=args["pp"],
                                                       ep=args["ep"], sequence_parallel=args["sp"]),
                   **common)


# --- steps ---------------------------------------------------------------------------------


@st.composite
def steps(draw, max_groups: int = 6, max_members: int = 5) -> Step:
    """Prefix groups of 1..max_members requests, 1..~16k tokens each, in length or token form.

    Length form: a group shares a prompt key (1..8192 tokens) or is lone requests.
    Token form: each group shares a random prefix; ids over a tiny vocabulary so that prefixes
    nest, requests repeat and whole requests are prefixes of others."""
    slots = draw(st.lists(st.sampled_from(SLOTS), min_size=1, max_size=3, unique=True))
    tokens = draw(st.sampled_from((False, False, False, True)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    vocab = draw(st.sampled_from((2, 5, 1000)))
    reqs: list[Request] = []
    for g in range(draw(st.integers(1, max_groups))):
        prefix = draw(st.sampled_from((0, draw(st.integers(1, 64)), draw(st.integers(1, 8192)))))
        members = draw(st.lists(st.one_of(st.integers(1, 64), st.integers(1, 8192)), min_size=1,
                                max_size=max_members))
        base = rng.integers(0, vocab, size=prefix)
        for m in members:
            i = len(reqs)
            slot, grad = draw(st.sampled_from(slots)), draw(st.sampled_from((True,) * 4 + (False,)))
            if tokens:
                ids = np.concatenate([base, rng.integers(0, vocab, size=m)])
                reqs.append(Request.from_tokens(f"t{i}", ids, slot=slot, grad=grad))
            elif prefix:
                reqs.append(Request(id=f"r{i}", num_tokens=prefix + m, prompt=f"p{g}",
                                    num_prompt_tokens=prefix, slot=slot, grad=grad))
            else:
                reqs.append(Request(id=f"r{i}", num_tokens=m, slot=slot, grad=grad))
    return Step.from_requests(reqs)


@st.composite
def atomic_units(draw, n: int) -> tuple[list[list[int]], bool]:
    """(units, bad): disjoint units of 1..4 requests, or (rarely) bad ones: an index out of
    range, a unit that overlaps another, an empty unit."""
    kind = draw(st.sampled_from(("none",) * 6 + ("units",) * 3 + ("bad",)))
    if kind == "none":
        return [], False
    perm = draw(st.permutations(range(n)))
    units, i = [], 0
    while i < n and len(units) < 3:
        k = draw(st.integers(1, 4))
        if draw(st.booleans()):
            units.append(sorted(perm[i:i + k]))
        i += k
    if kind == "units":
        return units, False
    flaw = draw(st.sampled_from(("range", "overlap", "empty")))
    if flaw == "range":
        units.append([draw(st.sampled_from((n, n + 5, -1)))])
    elif flaw == "overlap":
        units += [[0], [0, n - 1]]
    else:
        units.append([])
    return units, True


# budgets: a multiple of the largest single-request price, an absolute number of bytes (one
# byte to 1 PiB, log-uniform), a per-rank list, or an invalid value
INVALID_BUDGETS = (0, -1, -GIB, math.nan, math.inf, -math.inf, PIB + 1, 10 * PIB, True, "40")


@st.composite
def budgets(draw):
    """(kind, value): kind `relative` (a factor of `feasible_budget`), `ranks` (one factor per
    rank), `absolute` (bytes) or `invalid`; about 70/10/12/8 %."""
    kind = draw(st.sampled_from(("relative",) * 70 + ("ranks",) * 10 + ("absolute",) * 12
                                + ("invalid",) * 8))
    if kind == "relative":
        return kind, draw(st.sampled_from((1.0, 1.0, 1.01, 1.2, 1.5, 3.0, 10.0, 100.0, 0.5, 0.95)))
    if kind == "absolute":  # mostly 256 MiB .. 1 PiB, sometimes a few bytes or KiB
        return kind, int(2 ** draw(st.one_of(st.floats(28, 50), st.floats(28, 50), st.floats(0, 28))))
    if kind == "ranks":
        return kind, draw(st.lists(st.sampled_from((1.0, 1.2, 2.0, 5.0)), min_size=1, max_size=4))
    return kind, draw(st.sampled_from(INVALID_BUDGETS))


# --- helpers -------------------------------------------------------------------------------


def plan_json(plan) -> str:
    data = plan.to_dict()
    data.pop("planning_ms")
    data.pop("compile_ms", None)
    return json.dumps(data, sort_keys=True)


def feasible_budget(planner: Planner, step: Step) -> int:
    """A budget at which a plan exists: the largest exact price of one request alone (its
    slot's pending gradients included; one request per wave fits). With PP > 1 the pipeline
    schedule also holds other waves' gradients and RoPE entries beside a wave, so the budget
    also covers every stage's peak of a one-request-per-wave plan (the planner's last
    resort, `search.pipeline.pack_pipeline`); at PP1 the RoPE cache entries earlier waves
    leave, at the bound the planner falls back to (a full cache of the step's longest call)."""
    pricer = planner.pricer(step)
    worst = 0
    for i, r in enumerate(step.requests):
        fs = frozenset({r.slot}) if r.grad else frozenset()
        worst = max(worst, pricer.price([np.asarray([i])], first_slots=fs).admitted_bytes)
    if planner.model.parallel.pp > 1 and len(step.requests) > 1:
        alone = planner.plan(step, PIB, num_waves=len(step.requests), deterministic=True)
        worst = max([worst] + [s["peak_bytes"] for s in alone.stages])
    entry, instances = pricer.rope_entry_parts()
    if entry > 0 and len(step.requests) > 1:
        # PP1: the earlier waves' RoPE cache entries, at the planner's bound (Planner._with_earlier_rope)
        worst += rope_cache.reserve_bytes(entry, pricer.group_loads([np.arange(len(step.requests))]),
                                          planner.model.safety, instances)
    return worst


# --- properties ----------------------------------------------------------------------------


@pytest.mark.slow
@settings(max_examples=300, **RANDOM)
@given(geometry=geometries, data=st.data())
def test_a_layout_is_refused_exactly_when_it_breaks_a_documented_rule(geometry, data):
    g = _geometry(geometry)
    layout = data.draw(layouts(g, valid_share=0.5))
    args = data.draw(planner_args(geometry, layout, ["default"]))
    problems = layout_problems(g, *layout)
    try:
        make_planner(args)
    except ConfigError as exc:
        assert problems, f"valid layout {layout} refused: {exc}"
        field = str(exc).split("=", 1)[0]
        assert field in problems, (str(exc), problems)
        return
    assert not problems, f"layout {layout} accepted despite {sorted(problems)}"


@pytest.mark.slow
@settings(max_examples=1500, **RANDOM)
@given(geometry=geometries, step=steps(), budget=budgets(), data=st.data())
def test_random_plans_keep_the_invariants_and_are_deterministic(geometry, step, budget, data):
    g = _geometry(geometry)
    n = step.num_requests
    layout = data.draw(layouts(g), label="layout")
    slots = list(step.slot_names)
    missing_slot = len(slots) > 1 and data.draw(st.sampled_from(range(20)), label="drop a slot") == 7
    if missing_slot:
        slots = slots[1:]  # the step's first slot has no LoRA adapter
    extra = [s for s in SLOTS if s not in step.slot_names]
    if extra and data.draw(st.booleans(), label="an unused slot"):
        slots.append(extra[0])
    args = data.draw(planner_args(geometry, layout, slots), label="planner")
    packer = data.draw(st.sampled_from([*PackerKind, "auto", "greedy"]), label="packer")
    units, bad_units = data.draw(atomic_units(n), label="atomic units")
    num_waves = None  # mostly not set, and rarely with a baseline packer (a ConfigError)
    if data.draw(st.sampled_from(range(4)), label="set num_waves") == 1 and (
            PackerKind(packer) not in BASELINES or data.draw(st.sampled_from(range(5))) == 2):
        num_waves = data.draw(st.integers(1, n + 1), label="num_waves")
    kwargs = dict(packer=packer, atomic_units=units, num_waves=num_waves,
                  time_budget_ms=data.draw(st.sampled_from((1.0, 5.0, 20.0, 60.0)), label="ms"),
                  seed=data.draw(st.integers(0, 1000), label="seed"), deterministic=True)

    if layout_problems(g, *layout):
        try:
            make_planner(args)
        except ConfigError:
            event("invalid layout: ConfigError")
            return
        raise AssertionError(f"invalid layout {layout} accepted")
    planner = make_planner(args)

    # the budget, and which documented errors this input may raise
    kind, value = budget
    allowed: set[type[WaveplanError]] = set()
    faults = []
    feasible = False  # a budget at which every request fits alone
    if kind == "invalid":
        free = value
        faults.append(ConfigError)
    elif kind == "absolute":
        free = value
    else:
        try:
            worst = feasible_budget(planner, step)
        except ConfigError:
            assert missing_slot, "pricing refused a step whose every slot has an adapter"
            worst = GIB
        factors = value if kind == "ranks" else [value]
        free = [min(PIB, max(1, int(worst * f))) for f in factors]
        if kind == "relative":
            free = free[0]
        feasible = min(factors) >= 1.0 and not missing_slot
    if missing_slot:
        faults.append(ConfigError)
    if num_waves is not None and PackerKind(packer) in BASELINES:
        faults.append(ConfigError)
    if num_waves is not None and num_waves > n:
        faults.append(InfeasibleError)
    if bad_units:
        faults.append(StepError)
    allowed.update(faults)
    must_plan = (not faults and kind in ("relative", "ranks") and feasible and not units
                 and num_waves is None)
    if not must_plan:
        allowed.add(InfeasibleError)

    try:
        plan = planner.plan(step, free, **kwargs)
    except WaveplanError as exc:  # anything else fails the test
        assert type(exc) in allowed, (
            f"{type(exc).__name__}: {exc} (allowed: {sorted(c.__name__ for c in allowed)})")
        assert str(exc), "a documented error must say what is wrong"
        event(f"{type(exc).__name__}{' (input fault)' if faults else ''}: "
              f"{str(exc).split('=', 1)[0].split(' ', 1)[0]}")
        return
    assert not faults, f"planned despite a bad input that should raise {faults}"

    budget_bytes = int(min(free) if isinstance(free, list) else free)
    assert plan.budget_bytes == budget_bytes
    assert plan.packer == PackerKind(packer).value
    check_plan(step, planner.pricer(step), plan, budget_bytes=budget_bytes,
               atomic_units=units, num_waves=num_waves)
    again = make_planner(args).plan(step, free, **kwargs)  # a fresh planner: no shared state
    assert plan_json(again) == plan_json(plan), "planning is not deterministic"
    event(f"planned ({'guaranteed' if must_plan else 'may be infeasible'})")


TINY = ModelGeometry(name="tiny", hidden=64, ffn=96, vocab=50, gated_mlp=False,
                     layers=(LayerSpec("attention", "dense"),), attention=AttentionSpec(1, 1, 16))


def test_a_no_grad_step_that_fits_exactly_is_planned():
    # found by the property above: one 1-token no-grad request fits its exact price alone;
    # the envelope once charged the first-execution allowance (paid only by a wave with a
    # gradient group) as a constant and refused this budget
    planner = Planner(geometry=TINY)
    step = Step.from_requests([Request(id="a", num_tokens=1, grad=False)])
    fits = planner.pricer(step).price([np.asarray([0])]).admitted_bytes
    plan = planner.plan(step, fits, deterministic=True)
    assert plan.num_waves == 1

"""PNG figures of a plan (stacked memory terms per wave against the budget) and of a study.

matplotlib is optional (the `plot` extra) and imported only when a figure is drawn. Figures are
rendered by the Agg canvas directly, never through pyplot, so nothing here touches a caller's
global backend; files are written atomically (temp file in the same folder, then rename).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path

from waveplan.pricing.atomic_io import write_bytes_atomic
from waveplan.pricing.errors import ConfigError, bad

GIB = 2**30


def _figure(width: float, height: float):
    """A Figure bound to an Agg canvas; a ConfigError when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("plotting needs matplotlib: install the plot extra "
                          "(pip install 'waveplan[plot]')") from None
    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | Path) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    write_bytes_atomic(path, buffer.getvalue())


def _wave_price(i: int, wave: object) -> Mapping:
    """The priced part of wave i: the wave itself, or its nested `price` dict."""
    if not isinstance(wave, Mapping):
        raise bad(ConfigError, f"plan.waves[{i}]", wave, "must be an object")
    price = wave if "terms" in wave else wave.get("price")
    if not isinstance(price, Mapping) or not isinstance(price.get("terms"), Mapping):
        raise bad(ConfigError, f"plan.waves[{i}].terms", wave.get("terms"), "must be an object name -> bytes")
    for name, value in price["terms"].items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise bad(ConfigError, f"plan.waves[{i}].terms.{name}", value, "must be a number of bytes")
    return price


def plot_plan(plan: Mapping, path: str | Path) -> None:
    """Each wave's terms as stacked bars (GiB), the admitted headroom (safety) on top, and the
    budget as a line. Reads `plan["waves"][i]["terms"]` (or `["price"]["terms"]`),
    `admitted_bytes` per wave, and `budget_bytes` per wave or for the whole plan."""
    waves = plan.get("waves") if isinstance(plan, Mapping) else None
    if not isinstance(waves, list | tuple) or not waves:
        raise bad(ConfigError, "plan.waves", waves, "must be a non-empty list of waves")
    prices = [_wave_price(i, w) for i, w in enumerate(waves)]
    budgets = [w.get("budget_bytes", p.get("budget_bytes", plan.get("budget_bytes")))
               for w, p in zip(waves, prices, strict=True)]
    # Term order of first appearance; terms that are zero in every wave only clutter the legend.
    names = [n for n in dict.fromkeys(n for p in prices for n in p["terms"])
             if any(p["terms"].get(n, 0) for p in prices)]
    fig = _figure(max(6.0, 1.0 + 0.45 * len(waves)) + 2.5, 4.8)
    ax = fig.add_subplot()
    x = list(range(len(waves)))
    bottom = [0.0] * len(waves)
    colors = _colors(len(names))
    for name, color in zip(names, colors, strict=True):
        heights = [p["terms"].get(name, 0) / GIB for p in prices]
        ax.bar(x, heights, bottom=bottom, color=color, label=name, width=0.75)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    safety = [max(0.0, p.get("admitted_bytes", 0) / GIB - b) for p, b in zip(prices, bottom, strict=True)]
    if any(safety):
        ax.bar(x, safety, bottom=bottom, color="none", edgecolor="0.35", hatch="///", width=0.75,
               label="safety (admitted - raw)")
    if all(b is not None for b in budgets) and len(set(budgets)) == 1:
        ax.axhline(budgets[0] / GIB, color="crimson", ls="--", lw=1.5,
                   label=f"budget {budgets[0] / GIB:.2f} GiB")
    elif any(b is not None for b in budgets):  # per-wave budgets (e.g. ranks that differ)
        ax.scatter([i for i, b in enumerate(budgets) if b is not None],
                   [b / GIB for b in budgets if b is not None], marker="_", s=600, color="crimson",
                   label="budget", zorder=3)
    ax.set_xticks(x, [f"w{i}" for i in x], fontsize=8 if len(x) > 20 else 10)
    ax.set_xlabel("wave (run order)")
    ax.set_ylabel("GiB per rank")
    title = plan.get("title") or "plan"
    extra = [f"lower bound {plan['lower_bound_waves']}"] if "lower_bound_waves" in plan else []
    extra += [f"packer {plan['packer']}"] if "packer" in plan else []
    ax.set_title(f"{title}: {len(waves)} waves" + (f" ({', '.join(extra)})" if extra else ""))
    handles, labels = ax.get_legend_handles_labels()  # reversed: the legend reads like the stack
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path)


def _colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def plot_study(result, path: str | Path) -> None:
    """Two panels for a `StudyResult`: waves per step for every variant (markers dodged so
    ties stay visible; the first variant's lower bound as a grey line), and how many steps
    each variant ends 0, 1, 2, ... waves above its own lower bound."""
    steps, variants = result.steps, result.variants
    index = {(r.step, r.variant): r for r in result.rows}
    fig = _figure(min(16.0, max(8.0, 0.16 * len(steps) + 4)), 7.5)
    top, bottom = fig.subplots(2, 1, height_ratios=(3, 2))
    colors = _colors(len(variants))
    markers = "os^Dv<>pXh"
    spread = 0.6 / max(len(variants), 1)
    bound = [index[(s, variants[0])].lower_bound for s in steps]
    top.step(range(len(steps)), [b if b is not None else float("nan") for b in bound], where="mid",
             color="0.6", lw=2, label=f"lower bound ({variants[0]})", zorder=1)
    for k, (v, color) in enumerate(zip(variants, colors, strict=True)):
        xs, ys = [], []
        for i, s in enumerate(steps):
            if (w := index[(s, v)].waves) is not None:
                xs.append(i + (k - (len(variants) - 1) / 2) * spread)
                ys.append(w)
        top.scatter(xs, ys, s=18, color=color, marker=markers[k % len(markers)], label=v, zorder=2)
    top.set_xlabel("step")
    top.set_ylabel("waves")
    top.set_title(f"waves per step ({len(steps)} steps, budget {result.budget_bytes / GIB:.2f} GiB)")
    top.yaxis.get_major_locator().set_params(integer=True)
    top.grid(alpha=0.3)
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    aboves = [r.above_bound for r in result.rows if r.above_bound is not None]
    cap = min(max(aboves, default=0), 8)  # one bar group per count, the tail lumped at 8+
    labels = [str(j) for j in range(cap)] + [f"{cap}+" if max(aboves, default=0) > cap else str(cap)]
    width = 0.8 / max(len(variants), 1)
    for k, (v, color) in enumerate(zip(variants, colors, strict=True)):
        counts = [0] * len(labels)
        for s in steps:
            if (above := index[(s, v)].above_bound) is not None:
                counts[min(above, cap)] += 1
        xs = [j + (k - (len(variants) - 1) / 2) * width for j in range(len(labels))]
        bottom.bar(xs, counts, width=width, color=color, label=v)
    bottom.set_xticks(range(len(labels)), labels)
    bottom.set_xlabel("waves above the variant's lower bound")
    bottom.set_ylabel("steps")
    bottom.set_title("distance from the lower bound")
    bottom.grid(axis="y", alpha=0.3)
    _save(fig, path)

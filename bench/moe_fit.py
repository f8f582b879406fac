"""Refit the torch-cpu table's routed-row MoE coefficients on every MoE trace cell we have.

The entries fitted (pricing/data/coefficients/torch-cpu.json, `per_routed_row` only; their
`per_row` parts, the router and the shared expert, are kept):

- `moe_routed` {H, expert_ffn}: a MoE layer's recomputed (gradient) stage per routed row;
- `retained_moe_mlp` {H, expert_ffn}: what a retained MoE layer keeps (selective, none);
- `moe_nograd` {H, expert_ffn}: a MoE layer's forward transient;
- `moe_permutation` {H: 2} stays structural (the all-to-all dispatcher's sort copy).

Cells, each priced at its own layout (one first gradient wave, head full-native, 2-byte
adapter gradients, safety 1.0):

- single-rank cpu-fake (TP1): the MoE cells of bench/results/traces_cpu_fake.jsonl
  (qwen3-30b-a3b, qwen3.6-35b-a3b; full, selective, none) and traces_families_cpu_fake.jsonl
  (mixtral-8x7b, deepseek-v2-lite, deepseek-v3, gpt-oss-20b and its ablations; full), whole
  and decoder-only peaks (`measure.calibrate.estimate`). Their tracer's stand-in dispatcher
  makes no sort copy, so they are priced without `moe_permutation`
  (`calibrate.traced_dispatcher_table`);
- multi-rank (Megatron's all-to-all dispatcher, sort copy included): the MoE cells of
  traces_multirank.jsonl and traces_multirank_ep.jsonl at their layouts (TP1, EP2/4/8,
  TP2+SP+EP2, TP4+SP), at the default worst-case load and, for balanced cells at EP > 1,
  at the load 1 they ran (`bench/moe_validation.estimate`).

The fit (`fit`): each (H, expert_ffn) pair on a grid of 0.25 bytes, searched exhaustively;
the routed stage (`moe_routed`, with `moe_nograd` at its structural 6H) on the full-recompute
cells, then `moe_nograd` (floored at 6H) on every cell, then `retained_moe_mlp` on the
selective and no-recompute cells, then `moe_nograd` again. Each step keeps the pair with the
least mean estimate / trace (every family and recompute mode weighted alike; worst-case-load,
router and TP > 1 cells are constraints only) that leaves every cell at least `MARGIN` over
(the calibration's 0.5 %), or, for a cell these entries do not bind, no lower than it is with
them at 0. Deterministic.

Since issue 12's backward-point terms (docs/memory-model.md#moe-routed-points) `moe_routed` is
structural (6H + 10 expert_ffn) and a recomputed MoE layer's stage is the larger of two points
(`pricing.terms.mlp_stage_per_row`), so the walk is no longer linear in `moe_routed`:
bench/results/moe_fit.txt records the earlier fit, and `--write` must not be used for it.

Usage: python bench/moe_fit.py [--write]: writes bench/results/moe_fit.txt (per family and class,
and the fit without the DeepSeek cells); --write updates the entries in the table. The walk
points are linear in the coefficients (`linearise`: 7 pricings per cell), so the grid is
searched in numpy: seconds.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_validation import estimate as multirank_estimate  # noqa: E402

from waveplan.pricing.atomic_io import write_text_atomic  # noqa: E402
from waveplan.pricing.coefficients import CoefficientTable, load_table  # noqa: E402
from waveplan.pricing.measure import calibrate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench/results"
TABLE = ROOT / "pricing/data/coefficients/torch-cpu.json"
SINGLE = [RESULTS / "traces_cpu_fake.jsonl", RESULTS / "traces_families_cpu_fake.jsonl"]
MULTI = [RESULTS / "traces_multirank.jsonl", RESULTS / "traces_multirank_ep.jsonl"]
MARGIN = calibrate.MARGIN
STEP = 0.25
ENTRIES = ("moe_routed", "retained_moe_mlp", "moe_nograd")


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def cells() -> list[dict]:
    """Every MoE trace cell: {source, family, klass, record, multirank}."""
    out = []
    for path in SINGLE:
        for rec in _records(path):
            g = calibrate.cell_geometry(rec["cell"])
            if g.moe is None:
                continue
            out.append({"source": path.name, "family": rec["cell"]["model"],
                        "klass": f"cpu-fake TP1 {rec['cell']['recompute']}", "record": rec,
                        "multirank": False})
    for path in MULTI:
        for rec in _records(path):
            cell = rec["cell"]
            if not cell["geometry"]["moe"]:
                continue
            lay = cell["layout"]
            klass = f"TP{lay['tp']}{'+SP' if lay['sequence_parallel'] else ''}" \
                    + (f"+EP{lay['ep']}" if lay["ep"] > 1 else "") + f" {cell['recompute']}"
            loads = [None] + ([1.0] if cell.get("routing") == "balanced" and lay["ep"] > 1 else [])
            for load in loads:
                out.append({"source": path.name, "family": cell["geometry"]["name"],
                            "klass": klass + (" load 1" if load else "")
                            + (" router" if cell.get("routing") == "router" else ""),
                            "record": rec, "multirank": True, "load": load})
    return out


def price(table: CoefficientTable, c: dict) -> list[tuple[str, float]]:
    """[(what, estimate / trace)] of one cell: whole and decoder-only peaks (single rank), or
    the busiest rank (multi-rank)."""
    rec = c["record"]
    tr = rec["trace"]
    if c["multirank"]:
        raw, _ = multirank_estimate(rec["cell"], table, moe_load=c["load"])
        return [("busiest", raw / tr["peak_bytes"])]
    est = calibrate.estimate(table, rec)
    return [("whole", est["peak"] / tr["peak_bytes"]), ("decoder", est["decoder"] / tr["decoder_peak_bytes"])]


PARAMS = (("moe_routed", "H"), ("moe_routed", "expert_ffn"), ("retained_moe_mlp", "H"),
          ("retained_moe_mlp", "expert_ffn"), ("moe_nograd", "H"), ("moe_nograd", "expert_ffn"))


def with_coefficients(base: CoefficientTable, theta) -> CoefficientTable:
    """`base` with the `per_routed_row` coefficients of PARAMS set to `theta` (zeros dropped)."""
    terms = copy.deepcopy(base.terms)
    for name in {n for n, _ in PARAMS}:
        terms[name]["per_routed_row"] = {}
    for (name, width), value in zip(PARAMS, theta, strict=True):
        if value:
            terms[name]["per_routed_row"][width] = float(value)
    return CoefficientTable(backend=base.backend, terms=terms)


def _points(table: CoefficientTable, c: dict) -> list[tuple[str, np.ndarray, int]]:
    """[(what, walk points in bytes, traced peak)] of one cell under `table`
    (`calibrate.cell_points`; a multi-rank cell's model at its layout and load)."""
    rec = c["record"]
    tr = rec["trace"]
    if c["multirank"]:
        _, model = multirank_estimate(rec["cell"], table, moe_load=c["load"])
        original = calibrate._model
        calibrate._model = lambda _table, _cell: model   # the model `estimate` priced
        try:
            return [("busiest", calibrate.cell_points(table, rec), tr["peak_bytes"])]
        finally:
            calibrate._model = original
    return [("whole", calibrate.cell_points(table, rec), tr["peak_bytes"]),
            ("decoder", calibrate.cell_points(calibrate.decoder_table(table), rec), tr["decoder_peak_bytes"])]


def linearise(base: CoefficientTable, all_cells: list[dict]) -> list[dict]:
    """Each cell's walk points as affine functions of PARAMS: {cell, what, p0, slopes, peak}
    (points at theta = 0, and per unit of each parameter). Exact: every array `pricing.model`
    builds is linear in the table's coefficients. O(PARAMS x cells x layers)."""
    zero = np.zeros(len(PARAMS))
    at0 = [_points(with_coefficients(base, zero), c) for c in all_cells]
    units = []
    for k in range(len(PARAMS)):
        e = zero.copy()
        e[k] = 1.0
        units.append([_points(with_coefficients(base, e), c) for c in all_cells])
    out = []
    for i, c in enumerate(all_cells):
        for j, (what, p0, peak) in enumerate(at0[i]):
            slopes = np.stack([units[k][i][j][1] - p0 for k in range(len(PARAMS))], axis=1)
            out.append({"cell": c, "what": what, "p0": p0, "slopes": slopes, "peak": peak})
    return out


def ratios(lin: list[dict], theta: np.ndarray) -> np.ndarray:
    """estimate / trace of every linearised row at `theta` (an array of PARAMS, or a batch
    [n, PARAMS] giving [n, rows])."""
    theta = np.atleast_2d(theta)
    return np.stack([(row["p0"][None, :] + theta @ row["slopes"].T).max(axis=1) / row["peak"]
                     for row in lin], axis=1).squeeze()


def _grid(lo: float, hi: float) -> np.ndarray:
    return np.arange(round((hi - lo) / STEP) + 1) * STEP + lo


def tight(row: dict) -> bool:
    """Whether a row counts towards the fit's objective: single-rank cells, and multi-rank
    cells at TP1 priced at the load they ran (EP1, or balanced at load 1). The others
    (worst-case load, Megatron's router, TP > 1: bounds, far over) are constraints only."""
    c = row["cell"]
    if not c["multirank"]:
        return True
    cell = c["record"]["cell"]
    return (cell["layout"]["tp"] == 1 and cell.get("routing") != "router"
            and (cell["layout"]["ep"] == 1 or c["load"] == 1.0))


def needs(lin: list[dict]) -> np.ndarray:
    """The least ratio each row must keep: 1 + MARGIN, or, for a row the fitted terms do not
    bind (already >= 1 with them all at 0; prices only grow with them), its ratio at 0."""
    at0 = np.atleast_1d(ratios(lin, np.zeros(len(PARAMS))))
    return np.where(at0 >= 1.0, at0, 1.0 + MARGIN)


def _weights(lin: list[dict]) -> np.ndarray:
    """Objective weights: every family (model or grid shape) and recompute mode counts the
    same, whatever its number of cells; rows outside `tight` count 0."""
    keys = [(r["cell"]["family"], r["cell"]["record"]["cell"]["recompute"]) if tight(r) else None for r in lin]
    counts: dict = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    w = np.array([0.0 if k is None else 1.0 / counts[k] for k in keys])
    return w / w.sum()


def fit_pair(lin: list[dict], theta: np.ndarray, k: int, subset: np.ndarray,
             h_range: tuple[float, float], f_range: tuple[float, float]) -> np.ndarray:
    """theta with PARAMS[k] (H) and PARAMS[k + 1] (expert_ffn) set to the pair on the STEP
    grid with the least weighted mean ratio over the rows in `subset` that keeps every row at
    its `needs`. Exhaustive over the grid (vectorised). Ties: the smaller H, then F."""
    rows = [r for r, keep in zip(lin, subset, strict=True) if keep]
    need = needs(rows)
    w = _weights(rows)
    hs, fs = _grid(*h_range), _grid(*f_range)
    hh, ff = np.meshgrid(hs, fs, indexing="ij")
    batch = np.repeat(theta[None, :], hh.size, axis=0)
    batch[:, k], batch[:, k + 1] = hh.ravel(), ff.ravel()
    r = ratios(rows, batch).reshape(hh.size, len(rows))
    ok = (r >= need[None, :] - 1e-12).all(axis=1)
    if not ok.any():
        raise SystemExit(f"{PARAMS[k][0]}: no feasible pair in H {h_range}, expert_ffn {f_range}")
    score = np.where(ok, r @ w, np.inf)
    best = int(np.argmin(score))   # first minimum: the smallest H, then the smallest F
    out = theta.copy()
    out[k], out[k + 1] = batch[best, k], batch[best, k + 1]
    return out


def fit(lin: list[dict]) -> np.ndarray:
    """routed on the full-recompute rows (no-grad at its structural 6H), the no-grad
    transient on every row, the retained MoE on the selective and no-recompute rows, then the
    no-grad again with the retained fitted. O(grid x rows x points)."""
    full = np.array([r["cell"]["record"]["cell"]["recompute"] == "full" for r in lin])
    every = np.ones(len(lin), dtype=bool)
    theta = np.array([0.0, 0.0, 16.0, 16.0, 6.0, 0.0])
    theta = fit_pair(lin, theta, 0, full, (0.0, 16.0), (0.0, 16.0))
    theta = fit_pair(lin, theta, 4, every, (6.0, 12.0), (0.0, 12.0))
    theta = fit_pair(lin, theta, 2, ~full, (0.0, 12.0), (0.0, 16.0))
    theta = fit_pair(lin, theta, 4, every, (6.0, 12.0), (0.0, 12.0))
    return theta


def summary(lin: list[dict], theta: np.ndarray) -> list[str]:
    """Per family and class: rows, rows under their trace, median, worst and least
    estimate / trace - 1."""
    r = ratios(lin, theta)
    groups: dict[tuple[str, str], list[float]] = {}
    for row, v in zip(lin, r, strict=True):
        groups.setdefault((row["cell"]["family"], f"{row['cell']['klass']} {row['what']}"), []).append(float(v))
    lines = [f"{'family':46s} {'class':34s} cells under   median    worst    least"]
    for (fam, klass), rs in sorted(groups.items()):
        lines.append(f"{fam:46s} {klass:34s} {len(rs):5d} {sum(v < 1 for v in rs):5d} "
                     f"{statistics.median(rs) - 1:+8.2%} {max(rs) - 1:+8.2%} {min(rs) - 1:+8.2%}")
    return lines


SOURCE = ("fitted by bench/moe_fit.py (grid of 0.25 B; every MoE trace cell, each at its own "
          "layout: the MoE cells of bench/results/traces_cpu_fake.jsonl and "
          "traces_families_cpu_fake.jsonl, single-rank cpu-fake, whole and decoder-only peaks, "
          "priced without moe_permutation as their stand-in dispatcher makes no sort copy; "
          "traces_multirank.jsonl and traces_multirank_ep.jsonl, Megatron's all-to-all "
          "dispatcher at TP1, EP2/4/8, TP2+SP+EP2 and TP4+SP, worst-case and, balanced, load 1; "
          "every cell at least 0.5 % over, the least family-weighted mean estimate / trace)")
WHAT = {
    "moe_routed": "the recomputed MoE stage per routed row, H and expert_ffn separated by the "
                  "expert widths traced (expert_ffn / H from 0.25 to 3.5: Qwen3 MoE, the grid "
                  "shapes, DeepSeek-V2-Lite, DeepSeek-V3, gpt-oss-20b, Mixtral-8x7B). Plain "
                  "torch's anatomy is 6H + 10F (the permuted rows, the experts' outputs and "
                  "their concatenation, the fc1 input gradient; the fc1 output, activation and "
                  "their gradients), and without the DeepSeek cells the fit is 6H + 11F; "
                  "DeepSeek-V2-Lite and -V3 (MLA, shared experts) need about 2H per routed row "
                  "more at their widths, which binds H (bench/results/moe_fit.txt). The sort "
                  "copy is moe_permutation",
    "retained_moe_mlp": "what a retained MoE layer keeps per routed row (selective and no "
                        "recompute cells: Qwen3 MoE cpu-fake, the three grid shapes multi-rank); "
                        "per_row (router, shared expert) kept from the cpu-fake fit",
    "moe_nograd": "a MoE layer's forward transient per routed row, floored at its structural "
                  "6H (the permuted rows, the experts' outputs and their concatenation): no "
                  "cell's peak is bound by it above that; per_row (router probabilities) kept "
                  "from the cpu-fake fit",
}
PERMUTATION_SOURCE = (
    "structural 2H, held fixed while bench/moe_fit.py fitted the other MoE entries: the "
    "all-to-all dispatcher's sort of the top-k copies by local expert (sort_chunks_by_idxs: a cat of the permuted rows, 2H per routed row; "
    "`L0.mlp cat` in bench/results/layouts_anatomy.txt, MoE-wide TP1), which the single-rank "
    "tracer's stand-in dispatcher does not make: its cpu-fake cells are priced without it "
    "(measure.calibrate.traced_dispatcher_table), the multi-rank cells with it "
    "(pricing.moe_terms.permutation_per_routed_row)")


def write(theta: np.ndarray, old: CoefficientTable) -> None:
    """Replace the fitted `per_routed_row` coefficients and `source` of the three entries in
    the table file, line by line (the table keeps one entry per line; others untouched)."""
    text = TABLE.read_text(encoding="utf-8").splitlines(keepends=True)
    for name in ENTRIES:
        entry = copy.deepcopy(old.terms[name])
        entry["per_routed_row"] = {w: float(v) for (n, w), v in zip(PARAMS, theta, strict=True)
                                   if n == name and v}
        entry["source"] = f"{SOURCE}: {WHAT[name]}"
        prefix = f'    "{name}": '
        hits = [i for i, line in enumerate(text) if line.startswith(prefix)]
        if len(hits) != 1:
            raise SystemExit(f"{TABLE}: expected one line for {name}, found {len(hits)}")
        i = hits[0]
        comma = "," if text[i].rstrip().endswith(",") else ""
        ordered = {k: entry[k] for k in ("per_routed_row", "per_row") if k in entry}
        ordered["source"] = entry["source"]
        text[i] = prefix + json.dumps(ordered) + comma + "\n"
    hits = [i for i, line in enumerate(text) if line.startswith('    "moe_permutation": ')]
    if len(hits) == 1:
        entry = {k: v for k, v in old.terms["moe_permutation"].items() if k != "source"}
        entry["source"] = PERMUTATION_SOURCE
        comma = "," if text[hits[0]].rstrip().endswith(",") else ""
        text[hits[0]] = '    "moe_permutation": ' + json.dumps(entry) + comma + "\n"
    write_text_atomic(TABLE, "".join(text))


def without_deepseek(lin: list[dict]) -> list[str]:
    """The diagnostic behind the routed term's H: the same fit without the DeepSeek cells, and
    what those cells then lack, per row, in units of H."""
    rest = [r for r in lin if not r["cell"]["family"].startswith("deepseek")]
    theta = fit(rest)
    lines = ["fit without the DeepSeek cells: " + ", ".join(
        f"{n}.{w}={v:g}" for (n, w), v in zip(PARAMS, theta, strict=True))]
    for row, v in zip(lin, ratios(lin, theta), strict=True):
        if row["cell"]["family"].startswith("deepseek"):
            cell = row["cell"]["record"]["cell"]
            rows = sum(cell["seq_lens"])
            hidden = calibrate.cell_geometry(cell).hidden
            lack = ((1 + MARGIN) * row["peak"] - v * row["peak"]) / rows / hidden
            lines.append(f"  {row['cell']['family']:18s} {str(cell['seq_lens']):22s} {row['what']:8s} "
                         f"{v - 1:+7.2%}; lacks {lack:5.2f} H per row to {MARGIN:.1%} over")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update the table's MoE entries")
    args = parser.parse_args(argv)
    base = load_table("torch-cpu")
    all_cells = cells()
    lin = linearise(base, all_cells)
    theta = fit(lin)
    # the linearisation is exact: the fitted table, priced cell by cell, gives the same ratios
    # (to the rounding of raw bytes to integers)
    fitted = with_coefficients(base, theta)
    direct = np.array([r for c in all_cells for _, r in price(fitted, c)])
    if not np.allclose(direct, ratios(lin, theta), rtol=1e-6, atol=0):   # raw bytes are rounded
        raise SystemExit("linearised ratios differ from the priced ones")
    lines = ["torch-cpu MoE refit (bench/moe_fit.py): estimate / trace - 1 per family and class",
             "(single-rank cpu-fake: whole and decoder-only peaks, no sort copy; multi-rank: the busiest",
             "rank at the default worst-case load, and 'load 1' for balanced EP cells)", "",
             "fitted: " + ", ".join(f"{n}.{w}={v:g}" for (n, w), v in zip(PARAMS, theta, strict=True)),
             *summary(lin, theta), "", *without_deepseek(lin)]
    print("\n".join(lines))
    write_text_atomic(RESULTS / "moe_fit.txt", "\n".join(lines) + "\n")
    if args.write:
        write(theta, base)
        print(f"wrote {TABLE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

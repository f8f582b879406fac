"""The data-parallel group plan against veRL's way, on long-tailed GRPO batches.

    .venv/bin/python bench/dp_group_study.py [--seeds 3] [--out bench/results]

Batches: `long_tail_grpo` (8 completions per prompt; completions log-normal up to 32768 tokens,
the long tails clustered on hard prompts), 4 and 8 data-parallel ranks, 32, 64, 128 and 256 requests per rank;
qwen3.8-27b, TP4 with sequence parallelism, full recompute, LoRA rank 16, 40 GiB free per rank.
Every method is priced by the same memory model and timed by the same wave time model
(`pricing.time_model`, default coefficients); every wave of every method fits the budget.

* **veRL**: veRL's own functions (verl 0.9.1, CPU): the driver's `get_seqlen_balanced_partitions`
  on `calculate_workload` (24576 s + s^2) with equal counts, then on each rank
  `rearrange_micro_batches` with a token budget, the count agreed as the MAX over the ranks
  (re-run with `min_num_micro_batch` until every rank has the same count). The token budget
  is tuned per batch: the largest (multiple of 256) under which every micro-batch of every
  rank fits the memory budget (the first one with the adapter gradients) -- an oracle no
  trainer has, so veRL's figures here are its best case. Sequences run unshared, as veRL
  packs them.
* **balance+waveplan**: the same balance, then each share planned by waveplan, MAX count
  (what `plan_distributed` does).
* **group**: `plan_group` on the same unshared sequences.
* **group+prefix**: `plan_group` with shared prompts run once per wave (prefix trees), prompt
  groups whole on one rank unless splitting one saves a wave; beside it the best of veRL's
  balance (by sequence, by whole prompt group) then each share planned on the same step.

* **uneven**: the same on the unshared sequences with the odd ranks at 28 GiB free (veRL's
  one token budget must fit the smallest; each waveplan share is planned at its rank's budget).

Writes dp_group_study.txt (table), .csv and .png (waves and predicted step seconds).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from waveplan.planner import Planner  # noqa: E402
from waveplan.planner.group import plan_group  # noqa: E402
from waveplan.pricing.atomic_io import write_text_atomic  # noqa: E402
from waveplan.pricing.errors import InfeasibleError  # noqa: E402
from waveplan.pricing.step import Request, Step  # noqa: E402
from waveplan.pricing.time_model import wave_work  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 2**30
FREE_GIB = 40
UNEVEN_GIB = 28   # the odd ranks' free memory in the uneven runs
DPS = (4, 8)
PER_RANK = (32, 64, 128, 256)
COMPLETIONS = 8


def long_tail_grpo(*, prompts: int, completions: int, seed: int) -> Step:
    """A length-form GRPO batch with reasoning-length tails: prompts 256-4096 tokens
    (log-normal around 1100), a per-prompt median completion (log-normal around 1800, sigma
    0.7: hard prompts run long), completions log-normal around it (sigma 1.0), 64-32768 tokens."""
    rng = np.random.default_rng(seed)
    plen = np.clip(np.rint(1100 * np.exp(0.6 * rng.standard_normal(prompts))), 256, 4096).astype(int)
    med = 1800 * np.exp(0.7 * rng.standard_normal(prompts))
    clen = np.clip(np.rint(med[:, None] * np.exp(rng.standard_normal((prompts, completions)))),
                   64, 32768).astype(int)
    return Step.from_requests(
        Request(id=f"g{g}-c{c}", prompt=f"g{g}", num_prompt_tokens=int(plen[g]),
                num_tokens=int(plen[g] + clen[g, c]))
        for g in range(prompts) for c in range(completions))


def planner() -> Planner:
    return Planner.from_preset("qwen3.8-27b", tp=4, sequence_parallel=True, recompute="full",
                               lora_rank=16)


def unshared(step: Step) -> Step:
    """The same sequences with nothing shared (as veRL packs them)."""
    return Step.from_lengths(np.zeros(step.num_requests, np.int64), step.lengths, ids=list(step.ids))


def seconds_of(p: Planner, step: Step, waves) -> float:
    tm = p.time_model
    return float(sum(tm.seconds(*wave_work(step, [np.asarray(w, np.int64)])) for w in waves))


# --- veRL's way, with veRL's own functions -----------------------------------------------------


def verl_balance(step: Step, dp: int) -> list[list[int]]:
    import torch
    from verl.utils import seqlen_balancing as vsb

    work = vsb.calculate_workload(torch.tensor(step.lengths.tolist())).tolist()
    return vsb.get_seqlen_balanced_partitions(work, dp, equal_size=True)


def verl_micro_batches(lengths: list[list[int]], token_budget: int) -> list[list[list[int]]]:
    """Each rank's micro-batches (positions in its share) by veRL's `rearrange_micro_batches`,
    the count agreed as the MAX over the ranks."""
    import torch
    from tensordict import TensorDict
    from verl.utils import seqlen_balancing as vsb

    def batch(ls):
        width = max(ls)
        mask = (torch.arange(width)[None, :] < torch.tensor(ls)[:, None]).long()
        return TensorDict({"input_ids": torch.zeros_like(mask), "attention_mask": mask},
                          batch_size=len(ls))

    batches = [batch(ls) for ls in lengths]
    count = None
    while True:
        parts = [vsb.rearrange_micro_batches(b, max_token_len=token_budget, min_num_micro_batch=count)[1]
                 for b in batches]
        counts = {len(p) for p in parts}
        if len(counts) == 1:
            return parts
        count = max(counts)


def verl_way(p: Planner, step: Step, dp: int, budgets: list[int]):
    """(waves, predicted step seconds, token budget) of veRL's way at the largest token
    budget (one for every rank, as veRL has) that fits memory on every rank."""
    shares = verl_balance(step, dp)
    pricer = p.pricer(step)
    lengths = [[int(step.lengths[i]) for i in s] for s in shares]

    def fits(token_budget: int):
        parts = verl_micro_batches(lengths, token_budget)
        for share, mbs, budget in zip(shares, parts, budgets, strict=True):
            for k, mb in enumerate(mbs):
                idx = np.sort(np.asarray([share[j] for j in mb], np.int64))
                first = frozenset({"default"}) if k == 0 else frozenset()
                if pricer.price([idx], first_slots=first).admitted_bytes > budget:
                    return None
        return parts

    lo = int(step.lengths.max())
    if fits(lo) is None:
        raise InfeasibleError("veRL: a sequence alone does not fit")
    hi = int(max(sum(ls) for ls in lengths))
    lo_q, hi_q = lo // 256, hi // 256 + 1
    while lo_q < hi_q:   # largest multiple of 256 (or the longest sequence) that fits
        mid = (lo_q + hi_q + 1) // 2
        if mid * 256 >= lo and fits(mid * 256) is not None:
            lo_q = mid
        else:
            hi_q = mid - 1
    token_budget = max(lo, lo_q * 256)
    parts = fits(token_budget)
    waves = len(parts[0])
    secs = max(seconds_of(p, step, [[share[j] for j in mb] for mb in mbs])
               for share, mbs in zip(shares, parts, strict=True))
    return waves, secs, token_budget


def balance_then_plan(p: Planner, step: Step, dp: int, budgets: list[int]):
    """veRL's balance, each share planned by waveplan at its rank's budget, MAX count,
    re-planned at it (what `plan_distributed` does)."""
    shares = [sorted(s) for s in verl_balance(step, dp)]
    subs = [Step.from_requests([step.requests[i] for i in s]) for s in shares]
    count = max(p.plan(s, b, deterministic=True).num_waves for s, b in zip(subs, budgets, strict=True))
    secs = 0.0
    for share, sub, budget in zip(shares, subs, budgets, strict=True):
        plan = p.plan(sub, budget, deterministic=True, num_waves=count)
        idx = np.asarray(share)
        secs = max(secs, sum(p.time_model.seconds(*wave_work(step, [idx[c] for c in w.children]))
                             for w in plan.waves))
    return count, secs


# --- the study ---------------------------------------------------------------------------------

COLUMNS = ("dp", "per_rank", "seed", "verl_waves", "verl_s", "verl_token_budget", "bp_waves", "bp_s",
           "group_waves", "group_s", "group_bound", "prefix_waves", "prefix_s", "prefix_bound",
           "prefix_baseline_waves", "prefix_baseline_s", "group_ms", "prefix_ms",
           "uneven_verl_waves", "uneven_verl_s", "uneven_bp_waves", "uneven_bp_s",
           "uneven_group_waves", "uneven_group_s", "uneven_group_bound")


def run(seeds: int) -> list[dict]:
    p = planner()
    budget = FREE_GIB * GIB
    rows = []
    for dp in DPS:
        for per in PER_RANK:
            for seed in range(seeds):
                shared = long_tail_grpo(prompts=dp * per // COMPLETIONS, completions=COMPLETIONS,
                                   seed=1000 * dp + 10 * per + seed)
                step = unshared(shared)
                even = [budget] * dp
                vw, vs, vt = verl_way(p, step, dp, even)
                bw, bs = balance_then_plan(p, step, dp, even)
                t0 = time.perf_counter()
                g = plan_group(p, step, dp, budget)
                gms = (time.perf_counter() - t0) * 1e3
                t0 = time.perf_counter()
                h = plan_group(p, shared, dp, budget)
                hms = (time.perf_counter() - t0) * 1e3
                best = min(h.baselines.values(), key=lambda b: (b["waves"], b["seconds"]))
                uneven = [budget if r % 2 == 0 else UNEVEN_GIB * GIB for r in range(dp)]
                uvw, uvs, _ = verl_way(p, step, dp, uneven)
                ubw, ubs = balance_then_plan(p, step, dp, uneven)
                u = plan_group(p, step, dp, uneven)
                rows.append(dict(dp=dp, per_rank=per, seed=seed, verl_waves=vw, verl_s=vs,
                                 verl_token_budget=vt, bp_waves=bw, bp_s=bs,
                                 group_waves=g.num_waves, group_s=g.step_seconds,
                                 group_bound=g.lower_bound_waves, prefix_waves=h.num_waves,
                                 prefix_s=h.step_seconds, prefix_bound=h.lower_bound_waves,
                                 prefix_baseline_waves=best["waves"], prefix_baseline_s=best["seconds"],
                                 group_ms=gms, prefix_ms=hms, uneven_verl_waves=uvw,
                                 uneven_verl_s=uvs, uneven_bp_waves=ubw, uneven_bp_s=ubs,
                                 uneven_group_waves=u.num_waves, uneven_group_s=u.step_seconds,
                                 uneven_group_bound=u.lower_bound_waves))
                print(f"dp{dp} {per}/rank seed {seed}: veRL {vw} ({vs:.1f} s), balance+waveplan "
                      f"{bw} ({bs:.1f} s), group {g.num_waves} ({g.step_seconds:.1f} s), "
                      f"group+prefix {h.num_waves} ({h.step_seconds:.1f} s); uneven: veRL {uvw} "
                      f"({uvs:.1f} s), balance+waveplan {ubw} ({ubs:.1f} s), group {u.num_waves} "
                      f"({u.step_seconds:.1f} s)", file=sys.stderr)
    return rows


def table(rows: list[dict], seeds: int) -> str:
    out = io.StringIO()
    out.write(f"model qwen3.8-27b TP4 SP full recompute LoRA 16; {FREE_GIB} GiB free per rank; "
              f"GRPO batches, {COMPLETIONS} completions per prompt, {seeds} seeds per cell\n")
    out.write("waves: the maximum over ranks (every rank runs that many); s: predicted step "
              "seconds (the slowest rank, pricing.time_model defaults); mean over seeds\n\n")
    head = (f"{'dp':>3} {'req/rank':>8} | {'veRL':>6} {'s':>7} | {'bal+wp':>6} {'s':>7} | "
            f"{'group':>6} {'s':>7} {'bound':>5} | {'+prefix':>7} {'s':>7} {'bound':>5} "
            f"{'base':>5} {'s':>7} | {'ms':>6}")
    out.write(head + "\n" + "-" * len(head) + "\n")
    for dp in DPS:
        for per in PER_RANK:
            cell = [r for r in rows if r["dp"] == dp and r["per_rank"] == per]

            def m(k, c=cell):
                return float(np.mean([r[k] for r in c]))
            out.write(f"{dp:>3} {per:>8} | {m('verl_waves'):>6.2f} {m('verl_s'):>7.1f} | "
                      f"{m('bp_waves'):>6.2f} {m('bp_s'):>7.1f} | {m('group_waves'):>6.2f} "
                      f"{m('group_s'):>7.1f} {m('group_bound'):>5.2f} | {m('prefix_waves'):>7.2f} "
                      f"{m('prefix_s'):>7.1f} {m('prefix_bound'):>5.2f} "
                      f"{m('prefix_baseline_waves'):>5.2f} {m('prefix_baseline_s'):>7.1f} | "
                      f"{m('group_ms'):>6.0f}\n")
    out.write(f"\nuneven free memory: even ranks {FREE_GIB} GiB, odd ranks {UNEVEN_GIB} GiB "
              f"(sequences unshared)\n\n")
    head2 = (f"{'dp':>3} {'req/rank':>8} | {'veRL':>6} {'s':>7} | {'bal+wp':>6} {'s':>7} | "
             f"{'group':>6} {'s':>7} {'bound':>5}")
    out.write(head2 + "\n" + "-" * len(head2) + "\n")
    for dp in DPS:
        for per in PER_RANK:
            cell = [r for r in rows if r["dp"] == dp and r["per_rank"] == per]

            def m(k, c=cell):
                return float(np.mean([r[k] for r in c]))
            out.write(f"{dp:>3} {per:>8} | {m('uneven_verl_waves'):>6.2f} {m('uneven_verl_s'):>7.1f} | "
                      f"{m('uneven_bp_waves'):>6.2f} {m('uneven_bp_s'):>7.1f} | "
                      f"{m('uneven_group_waves'):>6.2f} {m('uneven_group_s'):>7.1f} "
                      f"{m('uneven_group_bound'):>5.2f}\n")
    n = len(rows)
    worse = sum(r["group_waves"] > r["bp_waves"] for r in rows)
    worse_p = sum(r["prefix_waves"] > r["prefix_baseline_waves"] for r in rows)
    fewer_v = sum(r["group_waves"] < r["verl_waves"] for r in rows)
    t_v = np.median([r["group_s"] / r["verl_s"] for r in rows])
    t_b = np.median([r["group_s"] / r["bp_s"] for r in rows])
    w_v = sum(r["verl_waves"] for r in rows) / sum(r["group_waves"] for r in rows)
    out.write(f"\n{n} batches. group vs veRL: fewer waves in {fewer_v}, {w_v:.2f}x veRL's waves "
              f"in all over the group's, median predicted step time {t_v:.3f}x veRL's; vs "
              f"balance+waveplan: more waves in {worse}, median step time {t_b:.3f}x. "
              f"group+prefix vs the best balance then plan on the same step: more waves in "
              f"{worse_p}.\n")
    u_worse = sum(r["uneven_group_waves"] > r["uneven_bp_waves"] for r in rows)
    u_fewer = sum(r["uneven_group_waves"] < r["uneven_bp_waves"] for r in rows)
    u_v = sum(r["uneven_verl_waves"] for r in rows) / sum(r["uneven_group_waves"] for r in rows)
    u_t = np.median([r["uneven_group_s"] / r["uneven_bp_s"] for r in rows])
    out.write(f"uneven: group vs balance+waveplan: fewer waves in {u_fewer}, more in {u_worse}, "
              f"median step time {u_t:.3f}x; veRL needs {u_v:.2f}x the group's waves in all.\n")
    out.write("columns: veRL = veRL's balance (24576 s + s^2, equal counts) then its token-budget "
              "micro-batches at the largest token budget that fits memory, MAX count; bal+wp = the "
              "same balance then waveplan per rank, MAX count; group = plan_group; +prefix = "
              "plan_group with shared prompts run once per wave, base = the best of veRL's balance "
              "(by sequence, by prompt group) then waveplan per rank on that step; bound = the "
              "group's lower bound on waves; ms = plan_group's planning time\n")
    return out.getvalue()


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(DPS), figsize=(10, 10), sharex=True, squeeze=False)
    series = (("verl", "veRL (token budget)"), ("bp", "veRL balance + waveplan"),
              ("group", "group plan"), ("prefix", "group plan, prefix trees"))
    for j, dp in enumerate(DPS):
        for key, label in series:
            w = [np.mean([r[f"{key}_waves"] for r in rows if r["dp"] == dp and r["per_rank"] == per])
                 for per in PER_RANK]
            s = [np.mean([r[f"{key}_s"] for r in rows if r["dp"] == dp and r["per_rank"] == per])
                 for per in PER_RANK]
            axes[0, j].plot(PER_RANK, w, marker="o", label=label)
            axes[1, j].plot(PER_RANK, s, marker="o", label=label)
        for key, label in series[:3]:
            w = [np.mean([r[f"uneven_{key}_waves"] for r in rows
                          if r["dp"] == dp and r["per_rank"] == per]) for per in PER_RANK]
            axes[2, j].plot(PER_RANK, w, marker="o", label=label)
        axes[2, j].set_ylabel(f"waves, odd ranks {UNEVEN_GIB} GiB free")
        axes[0, j].set_title(f"{dp} data-parallel ranks")
        axes[0, j].set_ylabel("waves (max over ranks)")
        axes[1, j].set_ylabel("predicted step seconds (slowest rank)")
        axes[2, j].set_xlabel("requests per rank")
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.set_xticks(PER_RANK, [str(x) for x in PER_RANK])
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"Long-tailed GRPO, qwen3.8-27b TP4 SP, {FREE_GIB} GiB free per rank "
                 f"(bottom: odd ranks {UNEVEN_GIB} GiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    rows = run(args.seeds)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{v:.6f}" if isinstance(v, float) else v) for k, v in r.items()})
    write_text_atomic(args.out / "dp_group_study.csv", buf.getvalue())
    text = table(rows, args.seeds)
    write_text_atomic(args.out / "dp_group_study.txt", text)
    plot(rows, args.out / "dp_group_study.png")
    print(text)


if __name__ == "__main__":
    main()

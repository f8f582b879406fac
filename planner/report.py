"""Planner reports: a plan with every input needed to re-plan it (model, coefficients,
profiles, requests, budget, options), and `replay`, which rebuilds and compares.

Requests are stored in the step's own form: length-form lines (`Step.to_length_form`) or,
for a token-form step, its prefix tree without loss (`Step.to_tree_form`).

A report needs no presets or coefficient files to replay: the geometry and the coefficient
table are stored in it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from waveplan.pricing.atomic_io import write_json_atomic
from waveplan.pricing.errors import ConfigError, StepError, WaveplanError, bad
from waveplan.pricing.frameworks import model_from_dict
from waveplan.pricing.step import Request, Step, step_from_tree_form
from waveplan.search import DEFAULT_PACKER, DEFAULT_SEED

from .plan import Plan
from .planner import Planner
from .profiles import ProfileStore

REPORT_SCHEMA = 1
REPORT_KIND = "waveplan-report"
_REQUEST_FIELDS = {"id", "prompt", "prompt_tokens", "completion_tokens", "slot", "grad"}


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """The `plan()` arguments a report records."""

    packer: str = DEFAULT_PACKER.value
    time_budget_ms: float | None = None   # None: the default rule (search.default_time_budget_ms)
    num_waves: int | None = None
    atomic_units: tuple[tuple[int, ...], ...] = ()
    seed: int = DEFAULT_SEED
    deterministic: bool = False

    def to_dict(self) -> dict:
        return {"packer": self.packer, "time_budget_ms": self.time_budget_ms,
                "num_waves": self.num_waves, "atomic_units": [list(u) for u in self.atomic_units],
                "seed": self.seed, "deterministic": self.deterministic}

    def kwargs(self) -> dict:
        return {"packer": self.packer, "time_budget_ms": self.time_budget_ms,
                "num_waves": self.num_waves, "atomic_units": self.atomic_units,
                "seed": self.seed, "deterministic": self.deterministic}


def build_report(planner: Planner, step: Step, plan: Plan, options: PlanOptions) -> dict:
    return {"schema": REPORT_SCHEMA, "kind": REPORT_KIND, "model": planner.model.to_dict(),
            "profiles": planner.profiles.to_dict(), "requests": report_lines(step),
            "budget_bytes": plan.budget_bytes, "options": options.to_dict(), "plan": plan.to_dict()}


def write_report(path: str | os.PathLike, planner: Planner, step: Step, plan: Plan,
                 options: PlanOptions) -> None:
    """Write the report atomically (a killed writer leaves any old report intact)."""
    write_json_atomic(path, build_report(planner, step, plan, options))


# --- reading ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedReport:
    planner: Planner
    step: Step
    budget_bytes: int
    options: PlanOptions
    plan: dict


def read_report(path: str | os.PathLike) -> LoadedReport:
    """Read and rebuild a report. Every problem is a ConfigError naming the file."""
    path = Path(path)
    where = f"report={str(path)!r}"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON (truncated or corrupt?): {exc.msg} "
                          f"at line {exc.lineno}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a JSON object")
    if data.get("kind") != REPORT_KIND:
        raise bad(ConfigError, f"{where}: kind", data.get("kind"), "not a waveplan report "
                  f"(expected {REPORT_KIND!r})")
    if data.get("schema") != REPORT_SCHEMA:
        raise bad(ConfigError, f"{where}: schema", data.get("schema"), "this waveplan reads report "
                  f"schema {REPORT_SCHEMA} only")
    missing = sorted({"model", "profiles", "requests", "budget_bytes", "options", "plan"} - set(data))
    if missing:
        raise ConfigError(f"{where}: {missing[0]}: missing field")
    try:
        model = model_from_dict(data["model"])
        store = ProfileStore.from_dict(data["profiles"], where="profiles")
        step = step_from_lines(data["requests"])
        options = _options(data["options"])
        budget = data["budget_bytes"]
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise bad(ConfigError, "budget_bytes", budget, "must be a positive integer")
        if not isinstance(data["plan"], dict):
            raise bad(ConfigError, "plan", type(data["plan"]).__name__, "must be an object")
    except WaveplanError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{where}: malformed: {type(exc).__name__}: {exc}") from None
    return LoadedReport(planner=Planner.from_model(model, profiles=store), step=step,
                        budget_bytes=budget, options=options, plan=data["plan"])


def report_lines(step: Step) -> list[dict]:
    """The report's `requests`: tree-form lines for a token-form step (its prefix tree kept
    exactly), length-form lines otherwise."""
    return step.to_tree_form() if step.is_token_form else step.to_length_form()


def step_from_lines(lines: object) -> Step:
    """A step from `report_lines` (tree-form lines when the first line has `tree_position`,
    length-form lines otherwise)."""
    if not isinstance(lines, list) or not lines:
        raise bad(StepError, "requests", lines, "must be a non-empty list")
    if isinstance(lines[0], dict) and "tree_position" in lines[0]:
        return step_from_tree_form(lines)
    requests = []
    for i, line in enumerate(lines):
        if not isinstance(line, dict) or set(line) - _REQUEST_FIELDS or "completion_tokens" not in line:
            raise bad(StepError, f"requests[{i}]", line, "not a length-form request line")
        prompt_tokens = line.get("prompt_tokens", 0)
        completion = line["completion_tokens"]
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (prompt_tokens, completion)):
            raise bad(StepError, f"requests[{i}]", line, "token counts must be integers")
        requests.append(Request(id=line.get("id"), num_tokens=prompt_tokens + completion,
                                prompt=line.get("prompt"), num_prompt_tokens=prompt_tokens,
                                slot=line.get("slot", "default"), grad=line.get("grad", True)))
    return Step.from_requests(requests)


def _options(data: object) -> PlanOptions:
    if not isinstance(data, dict):
        raise bad(ConfigError, "options", data, "must be an object")
    units = data.get("atomic_units", [])
    if not isinstance(units, list) or not all(isinstance(u, list) for u in units):
        raise bad(ConfigError, "options.atomic_units", units, "must be a list of lists")
    return PlanOptions(packer=data.get("packer", DEFAULT_PACKER.value),
                       time_budget_ms=data.get("time_budget_ms"),
                       num_waves=data.get("num_waves"), atomic_units=tuple(tuple(u) for u in units),
                       seed=data.get("seed", DEFAULT_SEED), deterministic=bool(data.get("deterministic", False)))


# --- replay -----------------------------------------------------------------------------


def replay(path: str | os.PathLike) -> tuple[dict, list[str]]:
    """Re-plan a report. Returns (the new plan's dict, differences as readable lines; empty
    when identical, ignoring the timings `planning_ms` and `compile_ms`)."""
    loaded = read_report(path)
    plan = loaded.planner.plan(loaded.step, free_bytes=loaded.budget_bytes, **loaded.options.kwargs())
    new = plan.to_dict()
    return new, diff_plans(loaded.plan, new)


def diff_plans(old: dict, new: dict) -> list[str]:
    """Readable differences between two plan dicts, naming the wave and field."""
    out = []
    for key in sorted((set(old) | set(new)) - {"planning_ms", "compile_ms", "waves"}):
        if old.get(key) != new.get(key):
            out.append(f"{key}: report {old.get(key)!r}, replay {new.get(key)!r}")
    old_w, new_w = old.get("waves", []), new.get("waves", [])
    if not isinstance(old_w, list):
        return out + [f"waves: report {type(old_w).__name__}, not a list"]
    if len(old_w) != len(new_w):
        out.append(f"waves: report has {len(old_w)}, replay has {len(new_w)}")
    for i, (a, b) in enumerate(zip(old_w, new_w, strict=False)):
        if not isinstance(a, dict):
            out.append(f"wave {i}: report entry is not an object")
            continue
        for key in sorted(set(a) | set(b)):
            va, vb = a.get(key), b.get(key)
            if va == vb:
                continue
            if key == "terms" and isinstance(va, dict) and isinstance(vb, dict):
                for term in sorted(set(va) | set(vb)):
                    if va.get(term) != vb.get(term):
                        out.append(f"wave {i}: terms.{term}: report {va.get(term)!r}, replay {vb.get(term)!r}")
            else:
                out.append(f"wave {i}: {key}: report {_short(va)}, replay {_short(vb)}")
    return out


def _short(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."

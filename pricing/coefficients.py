"""Calibration tables: per-stage workspace coefficients keyed by execution backend.

A table is JSON data shipped in `pricing/data/coefficients/<backend>.json` (or any file a user
fits with `waveplan calibrate`). Every entry carries its `source`. The walk's structure is the
same for every backend; only these numbers differ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .errors import ConfigError, bad

DEFAULT_BACKEND = "te-gpu"   # Transformer Engine on GPU: the shipped table a model prices with

# Widths a per-row coefficient may multiply (see `pricing.model.layer_widths`).
WIDTHS = ("H", "F", "qkv", "core", "in_proj", "conv", "value", "expert_ffn", "shared_ffn",
          "experts", "vocab", "rank")

REQUIRED_TERMS = (
    "boundary", "input_gradient", "residual_norm_shards", "norm_gathered", "mlp_dense_grad_stage",
    "mlp_dense_nograd", "attention_stage", "gdn_stage", "moe_routed", "moe_router",
    "moe_shared_expert", "gdn_state_bytes", "first_execution",
    "caller_per_logical_token", "head_chunk", "head_full_native", "head_full_te",
    "retained_attention_layer", "retained_gdn_layer", "retained_moe_mlp",
    "selective_core_attn_discount",
)
# Terms a table may omit, and what the pricing charges without them (neutral: the te-gpu
# table omits them all; the torch-cpu table is fitted with them, see `pricing.measure.calibrate`).
OPTIONAL_TERMS = {
    "qk_norm": "0: no query/key-norm copies beyond the attention stage",
    "final_norm": "0: the head terms cover the final norm's saved input",
    "final_norm_backward": "0: the head terms cover the final norm's backward",
    "retained_forward": "the no-grad transient alone at a retained layer's forward point",
    "retained_backward": "the recomputed layer's full stage workspace in a retained layer's backward",
    "moe_nograd": "the MoE gradient-stage workspace plus 6H as a MoE layer's forward transient",
    "moe_permutation": "0: the fitted MoE stage holds the dispatcher's top-k copies (pricing.moe_terms)",
    "moe_expert_backward": "the CPU trace's units (pricing.terms.EXPERT_BACKWARD_UNITS): conservative",
    "moe_routing_metadata": "0: the fitted MoE stage covers the router's per-choice bookkeeping",
    "moe_norm_inputs": "0: the mixer stage carries a MoE layer's norm inputs",
    "mla_norm_inputs": "0: the MLA stage alone (the norms' fp32 inputs not held on a GPU's fused norms)",
    "gdn_chunk_padding": "1: the GDN kernel runs no padding rows (FLA's chunked kernels mask the last chunk)",
}
_COEF_KEYS = ("per_row", "per_routed_row", "per_expert_row")
_SCALAR_KEYS = ("value", "per_row_vocab", "retained_per_row_vocab", "transient_per_row_vocab")


@dataclass(frozen=True)
class CoefficientTable:
    backend: str
    terms: dict  # name -> entry (dicts of width -> bytes, scalars, and "source")
    path: str = ""

    def __post_init__(self) -> None:
        missing = [name for name in REQUIRED_TERMS if name not in self.terms]
        if missing:
            raise bad(ConfigError, f"coefficients[{self.backend}]", missing[0], "missing term")
        for name, entry in self.terms.items():
            if not isinstance(entry, dict) or not entry.get("source"):
                raise bad(ConfigError, f"coefficients[{self.backend}].{name}.source", None,
                          "every entry must say where its numbers come from")
            for key in _COEF_KEYS:
                for width, value in entry.get(key, {}).items():
                    if width not in WIDTHS:
                        raise bad(ConfigError, f"coefficients[{self.backend}].{name}.{key}", width,
                                  f"unknown width; known: {', '.join(WIDTHS)}")
                    _check_number(f"coefficients[{self.backend}].{name}.{key}.{width}", value)
            for key in _SCALAR_KEYS:
                if key in entry:
                    _check_number(f"coefficients[{self.backend}].{name}.{key}", entry[key])

    def per_row(self, name: str, widths: dict[str, float], key: str = "per_row") -> float:
        """Bytes per row of term `name`: the sum of its coefficients times the given widths."""
        return float(sum(c * widths[w] for w, c in self.terms[name].get(key, {}).items()))

    def scalar(self, name: str, key: str = "value") -> float:
        return float(self.terms[name][key])

    def source(self, name: str) -> str:
        return self.terms[name]["source"]

    def to_dict(self) -> dict:
        return {"backend": self.backend, "terms": self.terms}


def _check_number(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise bad(ConfigError, field, value, "must be a number >= 0")


def list_backends() -> list[str]:
    root = resources.files("waveplan.pricing") / "data" / "coefficients"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_table(backend: str = DEFAULT_BACKEND) -> CoefficientTable:
    """A shipped table by backend name, or a table file by path."""
    if backend.endswith(".json") or "/" in backend:
        path = Path(backend)
        try:
            text = path.read_text()
        except OSError as exc:
            raise bad(ConfigError, "backend", backend, f"cannot read table file: {exc.strerror}") from None
    else:
        if backend not in list_backends():
            raise bad(ConfigError, "backend", backend, f"unknown backend; known: {', '.join(list_backends())}")
        res = resources.files("waveplan.pricing") / "data" / "coefficients" / f"{backend}.json"
        text, path = res.read_text(), Path(str(res))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad(ConfigError, "backend", backend, f"table is not valid JSON (line {exc.lineno})") from None
    return table_from_dict(data, path=str(path))


def table_from_dict(data: dict, *, path: str = "") -> CoefficientTable:
    if not isinstance(data, dict) or "backend" not in data or not isinstance(data.get("terms"), dict):
        raise bad(ConfigError, "coefficients", path or "<dict>", "needs 'backend' and a 'terms' object")
    return CoefficientTable(backend=str(data["backend"]), terms=data["terms"], path=path)

"""What Megatron-core's torch chunked gated-delta rule keeps for its backward, alone: the storages
autograd saves in `torch_chunk_gated_delta_rule` (saved-tensor hooks; inputs excluded), per wave
length, so the per-chunk step and the padding show (docs/memory-model.md#gdn-sp-retained,
`pricing.gdn_terms.gdn_kernel_per_row`).

    python bench/gdn_kernel_saved.py [rows ...]     # default 64 65 128 192 256 320, 2 value heads

Prints, per wave length, the saved bytes, the chunks (rows padded to 64) and the bytes per chunk
and value head beside the formula's. Seconds on one core.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def saved_bytes(rows: int, heads: int = 2, dk: int = 128, dv: int = 128) -> int:
    import torch
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

    torch.manual_seed(0)
    q, k = (torch.randn(1, rows, heads, dk, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(1, rows, heads, dv, dtype=torch.bfloat16, requires_grad=True)
    g = (-torch.rand(1, rows, heads)).requires_grad_()
    beta = torch.rand(1, rows, heads, requires_grad=True)
    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v, g, beta)}
    store: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in inputs:
            store[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta)
    return sum(store.values())


def main(argv=None) -> int:
    from waveplan.pricing import gdn_terms
    from waveplan.pricing.geometry import GdnSpec

    rows_list = [int(x) for x in (argv if argv is not None else sys.argv[1:])] or [64, 65, 128, 192, 256, 320]
    heads = 2
    spec = GdnSpec(num_key_heads=heads, num_value_heads=heads, key_head_dim=128, value_head_dim=128, conv_kernel=4)
    per_chunk = 64 * gdn_terms.gdn_kernel_per_row(spec, tp=1) / heads
    for rows in rows_list:
        n = -(-rows // 64)
        b = saved_bytes(rows, heads)
        print(f"rows {rows:5d}  chunks {n:3d}  saved {b:10d} B  per chunk and value head {b / n / heads:10.1f} "
              f"(formula {per_chunk:.0f}; formula x chunks - saved: {per_chunk * n * heads - b:.0f} B)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env bash
# Trace the FSDP grid (Hugging Face transformers + PEFT LoRA under FSDP2, one GPU, nccl) and a
# Megatron-core grid (existing `waveplan trace`) with --device cuda; results in bench/results/.
# Sized for one H100/H200 within about 10 minutes. Not run in the session that wrote it (no GPU
# was lent); run it where one is:  bash bench/gpu_grid.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export TORCHDYNAMO_DISABLE=1
PY=${PY:-.venv/bin/python}
WAVEPLAN=${WAVEPLAN:-.venv/bin/waveplan}
OUT=bench/results
mkdir -p "$OUT"

# FSDP: Qwen3-8B's and Llama-3.1-8B's shapes with 4 decoder layers, sdpa and eager, checkpointing
# on and off, shard group 1 (one GPU); every record priced beside its peak
"$PY" - <<'PYEOF'
import json
from waveplan.pricing.fsdp.check import price_record
from waveplan.pricing.measure.fsdp_trace import trace_fsdp

QWEN3_8B = dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=4,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                tie_word_embeddings=False)
LLAMA_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                tie_word_embeddings=False)
waves = [(2048, 1024, 1024), (4096,)]
with open("bench/results/gpu_fsdp_traces.jsonl", "w", encoding="utf-8") as fh:
    for name, cfg in (("qwen3", QWEN3_8B), ("llama", LLAMA_8B)):
        for ckpt in (True, False):
            for attn in ("sdpa", "eager"):
                for t in trace_fsdp(cfg, jobs=waves, fsdp=1, attn=attn, checkpointing=ckpt,
                                    lora_rank=16, device="cuda", timeout_s=300):
                    rec = t.to_dict()
                    rec["priced_raw_bytes"] = price_record(rec).raw_bytes
                    rec["class"] = f"gpu:{name}/{'ckpt' if ckpt else 'nockpt'}/{attn}/fsdp1"
                    fh.write(json.dumps(rec, sort_keys=True) + "\n")
                    print(rec["class"], rec["seq_lens"], rec["peak_bytes"], rec["priced_raw_bytes"],
                          f"{100 * (rec['priced_raw_bytes'] / rec['peak_bytes'] - 1):+.1f}%", flush=True)
PYEOF

# Megatron-core: the existing tracer on the GPU (4 layers of two presets, full recompute), on a
# wave of 8 x 1024 and one of 2 x 4096 tokens
STEPS=$(mktemp -d)
"$PY" - "$STEPS" <<'PYEOF'
import json, sys
for name, lens in (("short", [1024] * 8), ("long", [4096] * 2)):
    with open(f"{sys.argv[1]}/{name}.jsonl", "w") as fh:
        for i, n in enumerate(lens):
            fh.write(json.dumps({"id": f"{name}{i}", "completion_tokens": n}) + "\n")
PYEOF
: > "$OUT/gpu_megatron_traces.jsonl"
for model in qwen3-8b llama-3.1-8b; do
  for step in short long; do
    "$WAVEPLAN" trace "$STEPS/$step.jsonl" --model "$model" --layers 4 --device cuda --json \
      >> "$OUT/gpu_megatron_traces.jsonl"
  done
done

# The default te-gpu table's classes on the device (issue 33): dense retained and full, retained MoE,
# MLA, a GDN hybrid, and the seed's MoE full-recompute cell (qwen3-30b-a3b, 8 layers, 16,384 tokens
# in 32 sequences: the wave whose 8.8 KB/token no kernel model explains, docs/memory-model.md#moe-full-seed-gap).
# What this measures: the tracer builds Megatron's local spec (torch modules), with `--kernels
# te-gpu` the fused kernels' allocation models in place of TE, flash-attn and FLA, now on the CUDA
# caching allocator; so it checks what the CPU traces cannot (the allocator's rounding, cuBLAS
# workspaces, what the device-side PyTorch ops keep), not the real TE kernels, which need a TE-spec
# model on the device. Each cell is priced on the table its kernels name beside its peak; a cell
# that fails on the device is reported and the script goes on.
"$PY" - "$STEPS" <<'PYEOF'
import json, sys
with open(f"{sys.argv[1]}/seed.jsonl", "w") as fh:
    for i in range(32):
        fh.write(json.dumps({"id": f"s{i}", "completion_tokens": 512}) + "\n")
PYEOF
: > "$OUT/gpu_te_gpu_traces.jsonl"
te_cell() {  # model layers recompute step
  "$WAVEPLAN" trace "$STEPS/$4.jsonl" --model "$1" --layers "$2" --recompute "$3" --device cuda \
    --kernels te-gpu --json \
    >> "$OUT/gpu_te_gpu_traces.jsonl" || echo "failed: $*" >&2
}
for mode in none selective full; do te_cell qwen3-8b 4 "$mode" short; done
te_cell qwen3-30b-a3b 8 full seed
te_cell qwen3-30b-a3b 4 none short
te_cell deepseek-v2-lite 4 none short
te_cell qwen3.8-27b 4 none short
te_cell qwen3.8-27b 4 full short
"$PY" - "$OUT/gpu_te_gpu_traces.jsonl" <<'PYEOF'
import json, sys
sys.path.insert(0, "bench")
from multirank_grid import current_estimate
for line in open(sys.argv[1], encoding="utf-8"):
    rec = json.loads(line)
    table = rec.get("kernels", "torch-cpu")
    cell = {"geometry": rec["geometry"], "num_layers": rec["num_layers"], "layout": {},
            "recompute": rec["recompute"]["mode"], "lora_rank": rec["lora_rank"] or 16,
            "seq_lens": rec["seq_lens"]}
    price = current_estimate(cell, table=table, head=rec["head"])
    print(f"{table} {rec['model']} {rec['num_layers']} layers {rec['recompute']['mode']} {rec['tokens']} tokens: "
          f"peak {rec['peak_bytes']:,d} B, priced {price['raw_bytes']:,.0f} B, "
          f"{price['raw_bytes'] / rec['peak_bytes']:.3f} ({price['basis']})", flush=True)
PYEOF
rm -rf "$STEPS"
echo "wrote $OUT/gpu_fsdp_traces.jsonl, $OUT/gpu_megatron_traces.jsonl and $OUT/gpu_te_gpu_traces.jsonl"

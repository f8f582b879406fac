"""waveplan.pricing.measure: everything that runs a model to measure its memory.

The memory model (`waveplan.pricing`) prices a wave from coefficients; this room holds the
code that runs Megatron-core models to produce and check those numbers:

- `megatron_build`: a `GPTModel` with a geometry's shapes and LoRA adapters;
  `megatron_shim`: Megatron on the CPU in one process (a gloo group, or torch's fake
  process group for per-rank shapes of TP > 1);
- `trace`: one wave's peak, on fake tensors, real CPU tensors or CUDA; `thd`: the packed
  (THD) sequence helpers it shares with `megatron_build` and `training_wave`;
- `training_wave`: a real training wave of a training loop, measured as `trace` measures;
- `live_geometry`: a geometry, layout and LoRA setting read back from a live model;
- `calibrate`: a coefficient table fitted to traced peaks (an LP; `simplex` solves it when
  OR-Tools is absent);
- `multirank`: one wave on every rank of a TP/SP/CP/EP layout, one process per rank over
  gloo with real CPU tensors; `ring_attention`: the CP ring attention those ranks run (an
  allocation model of Megatron's); `live_anatomy`: which modules hold the bytes of a rank's
  peaks.

Importing this package imports none of them: torch and megatron-core (the `megatron` extra)
load only with the submodules that need them, and `waveplan.pricing`, `waveplan.search` and
`waveplan.planner` import this room only inside the functions that run it.
"""

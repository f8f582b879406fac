"""Trainer glue: waveplan inside the training loops that run Megatron-core models.

* `waveplan.planner.integrations.verl`: a memory-priced drop-in for veRL's
  `verl.utils.seqlen_balancing.rearrange_micro_batches` (same return contract, same
  data-parallel agreement), and `install` to put it under veRL's own engine.
* `waveplan.planner.integrations.megatron`: run one planned step through Megatron-core's
  `get_forward_backward_func()`, one micro-batch per wave, peaks fed to `Planner.observe`.

Both import torch (and veRL / Megatron-core) lazily, when called.
"""

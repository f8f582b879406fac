"""waveplan.pricing.measure: everything that runs a model to measure its memory.

The tracers, the live readers and the table fit, one module each (docs/architecture.md#measure-room;
how each runs: docs/measurement.md). Importing this package imports none of them: torch and
megatron-core load only with the submodules that need them, and the other rooms import this
one only inside the functions that run it.
"""

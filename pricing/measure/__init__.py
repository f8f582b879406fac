"""Measuring what a wave holds: traces on fake tensors, on the CPU and over gloo."""

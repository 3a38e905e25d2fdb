"""Benchmarks of the toolkit; run one with ``python -m benchmarks.<name>``."""

"""Benchmarks. `python -m bench` runs them all and writes BENCHMARKS.md."""

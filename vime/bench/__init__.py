"""Benchmarks runnable as `vime bench NAME` (see `vime.cli`)."""

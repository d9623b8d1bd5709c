"""Benchmarks (see bench/README.md); importable as `bench.<name>` from the repository root."""

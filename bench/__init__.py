"""Benchmarks of issue 6: each prints a table and writes JSON (see docs/performance.md)."""

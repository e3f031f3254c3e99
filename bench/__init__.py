"""The benchmarks: each prints a table and writes JSON (see docs/performance.md)."""

"""Fault-injection helpers for tests/test_reliability*.py (never imported by offload/)."""

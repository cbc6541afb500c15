"""Benchmarks: scripts that print a table and write JSON (run as python -m benchmarks.NAME)."""

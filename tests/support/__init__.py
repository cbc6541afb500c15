"""Test and benchmark support: synthetic engines, peer processes and helpers shared by tests/ and benchmarks/."""

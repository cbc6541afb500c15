"""Checks that need a CUDA GPU (and NIXL): skipped elsewhere, never faked into passing."""

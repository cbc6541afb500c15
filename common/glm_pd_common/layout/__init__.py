"""Layout math: geometry, byte formats, regions, page math, TP mapping, plans, fingerprints, digests.

Pure: numpy, msgspec and xxhash only; no threads, no sockets, no engine imports.
"""

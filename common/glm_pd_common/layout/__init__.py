"""Layout math: geometry, byte formats, regions, page math, TP mapping, plans, fingerprints, digest order.

Pure: numpy, msgspec and xxhash only; no memory access, no threads, no sockets, no engine imports.
"""

"""Transports that move the bytes: one interface (``base``) over NIXL (UCX) and Mooncake, and how this rank reads
its own registered memory (``memory``) for the digests of what moved (``digests``)."""

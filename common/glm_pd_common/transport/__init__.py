"""Transports that move the bytes: one interface (``base``) over NIXL (UCX) and Mooncake."""

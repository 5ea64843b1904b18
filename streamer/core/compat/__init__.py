"""Adapters for the wire protocols that existing clients speak (sans-I/O, like protocol v1)."""

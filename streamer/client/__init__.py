"""The protocol v1 client: one async implementation used by ``streamer client``, the
examples, the bench and the tests.
"""

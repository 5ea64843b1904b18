"""What hostile clients send, shared by the hostile-client tests (issue 32) and
``bench/stress/``: files whose headers lie, bodies that drip."""

from __future__ import annotations


def wav_header(*, sample_rate: int, bits: int, channels: int, data_bytes: int) -> bytes:
    """A PCM WAV header declaring these (any values, absurd ones included)."""
    block = channels * bits // 8
    fmt = (
        (1).to_bytes(2, "little")
        + channels.to_bytes(2, "little")
        + sample_rate.to_bytes(4, "little")
        + (sample_rate * block).to_bytes(4, "little")
        + block.to_bytes(2, "little")
        + bits.to_bytes(2, "little")
    )
    return (
        b"RIFF"
        + (36 + data_bytes).to_bytes(4, "little")
        + b"WAVEfmt "
        + len(fmt).to_bytes(4, "little")
        + fmt
        + b"data"
        + data_bytes.to_bytes(4, "little")
    )

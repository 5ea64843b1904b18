import numpy as np
import pytest

from streamer.core.framing import AudioBuffer, PcmFramer


def test_framer_carries_odd_bytes_and_partial_frames():
    pcm = np.arange(1000, dtype=np.int16)
    data = pcm.tobytes()
    framer = PcmFramer(160)
    frames = []
    # chunk sizes that split samples in half and frames anywhere
    offset = 0
    sizes = [1, 3, 7, 333, 2, 999, 5, 10_000]
    for size in sizes:
        frames += framer.push_bytes(data[offset : offset + size])
        offset += size
    assert all(f.size == 160 for f in frames)
    got = np.concatenate(frames + [framer.flush()])
    np.testing.assert_array_equal(got, pcm)


def test_framer_empty_and_flush():
    framer = PcmFramer(320)
    assert framer.push_bytes(b"") == []
    assert framer.push_bytes(b"\x01") == []  # half a sample
    assert framer.pending_samples == 0
    framer.push_bytes(b"\x00")
    assert framer.pending_samples == 1
    assert framer.flush().tolist() == [1]
    assert framer.flush().size == 0


def test_framer_rejects_bad_size():
    with pytest.raises(ValueError):
        PcmFramer(0)


def test_audio_buffer_slices_by_absolute_index_and_discards():
    buffer = AudioBuffer()
    buffer.append(np.arange(100, dtype=np.int16))
    buffer.append(np.arange(100, 250, dtype=np.int16))
    assert buffer.end_sample == 250
    np.testing.assert_array_equal(buffer.slice(90, 110), np.arange(90, 110))
    buffer.discard_before(120)
    assert buffer.retained_samples == 130
    np.testing.assert_array_equal(buffer.slice(120, 125), np.arange(120, 125))
    with pytest.raises(IndexError):
        buffer.slice(100, 130)
    buffer.discard_before(10)  # going backwards is a no-op
    assert buffer.retained_samples == 130


def test_s16_decoder_carries_odd_byte():
    from streamer.core.framing import S16Decoder

    pcm = np.arange(-50, 50, dtype=np.int16)
    data = pcm.tobytes()
    decoder = S16Decoder()
    parts = [decoder.push(data[i : i + 7]) for i in range(0, len(data), 7)]
    np.testing.assert_array_equal(np.concatenate(parts), pcm)

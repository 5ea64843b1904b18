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


def test_framer_blocks_are_the_frames_as_rows():
    pcm = np.arange(-3000, 3000, dtype=np.int16)
    data = pcm.tobytes()
    by_list, by_block = PcmFramer(320), PcmFramer(320)
    offset = 0
    for size in [3200, 1, 639, 3200, 5, 6400, 3]:
        chunk = data[offset : offset + size]
        offset += size
        frames, block = by_list.push_bytes(chunk), by_block.push_bytes_block(chunk)
        assert block.shape == (len(frames), 320)
        for frame, row in zip(frames, block, strict=True):
            np.testing.assert_array_equal(frame, row)
    np.testing.assert_array_equal(by_list.flush(), by_block.flush())


def test_audio_buffer_takes_a_block_row_after_row():
    buffer = AudioBuffer()
    buffer.append(np.arange(960, dtype=np.int16).reshape(3, 320))
    assert buffer.end_sample == 960
    piece = buffer.slice(300, 700)
    np.testing.assert_array_equal(piece, np.arange(300, 700))
    assert piece.dtype == np.int16 and piece.flags.writeable
    buffer.discard_before(640)  # a slice handed out does not pin the buffer's memory
    assert buffer.retained_samples == 320


def test_frame_energies_are_frame_energy_bit_for_bit():
    from streamer.core.vad import frame_energies, frame_energy

    rng = np.random.default_rng(0)
    for scale in (1, 30, 3000, 32767):
        block = rng.integers(-scale, scale, size=(7, 320), endpoint=True).astype(np.int16)
        assert frame_energies(block) == [frame_energy(frame) for frame in block]
    assert frame_energies(np.zeros((0, 320), np.int16)) == []

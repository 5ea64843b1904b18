"""What the compatible protocols share: G.711 and channel decoding, language tags, words."""

from __future__ import annotations

import numpy as np
import pytest

from streamer.core.compat import common
from streamer.core.compat.audio import ALAW_TO_S16, ULAW_TO_S16, AudioDecoder


def test_g711_tables() -> None:
    # ITU-T G.711 reference points: silence, both extremes, the smallest steps
    assert ULAW_TO_S16[[0xFF, 0x7F, 0x00, 0x80, 0xFE, 0x7E]].tolist() == [
        0,
        0,
        -32124,
        32124,
        8,
        -8,
    ]
    assert ALAW_TO_S16[[0xD5, 0x55, 0xAA, 0x2A]].tolist() == [8, -8, 32256, -32256]
    for table in (ULAW_TO_S16, ALAW_TO_S16):  # odd symmetric, monotonic per sign half
        assert sorted(table.tolist()) == sorted((-table).tolist())
        assert len(set(table.tolist())) >= 255
    try:
        import audioop  # the standard library had G.711 until Python 3.13
    except ImportError:
        return
    codes = bytes(range(256))
    assert np.frombuffer(audioop.ulaw2lin(codes, 2), "<i2").tolist() == ULAW_TO_S16.tolist()
    assert np.frombuffer(audioop.alaw2lin(codes, 2), "<i2").tolist() == ALAW_TO_S16.tolist()


@pytest.mark.parametrize("chunk", [1, 3, 7, 4096])
def test_decoders_carry_partial_frames(chunk: int) -> None:
    rng = np.random.default_rng(1)
    stereo = rng.integers(-20000, 20000, size=(4000, 2), dtype=np.int16)
    data = stereo.reshape(-1).tobytes()
    decoder = AudioDecoder("linear16", channels=2)
    out = b"".join(decoder.push(data[i : i + chunk]) for i in range(0, len(data), chunk))
    expected = (stereo.astype(np.int32).sum(axis=1) // 2).astype("<i2")
    assert out == expected.tobytes()
    codes = rng.integers(0, 256, size=3000, dtype=np.uint8).tobytes()
    decoder = AudioDecoder("mulaw")
    out = b"".join(decoder.push(codes[i : i + chunk]) for i in range(0, len(codes), chunk))
    assert out == ULAW_TO_S16[np.frombuffer(codes, np.uint8)].astype("<i2").tobytes()
    assert AudioDecoder().push(b"\x01\x02\x03") == b"\x01\x02\x03"  # mono PCM passes through


@pytest.mark.parametrize(
    ("tag", "language"),
    [("en-US", "en"), ("EN_gb", "en"), ("zh", "zh"), ("zh-TW", "zh"), ("zh-HK", "yue"),
     ("yue", "yue"), ("ja-JP", "ja"), ("ko", "ko"), ("multi", "auto"), ("de", "auto"),
     ("", "auto"), (None, "auto"), (3, "auto")],
)  # fmt: skip
def test_core_language(tag: object, language: str) -> None:
    assert common.core_language(tag) == language


def test_lenient_values() -> None:
    assert common.lenient_bool("TRUE", False) and not common.lenient_bool("off", True)
    assert common.lenient_bool("maybe", True) and not common.lenient_bool(None, False)
    assert common.lenient_int("300") == 300 and common.lenient_int(250.0) == 250
    assert common.lenient_int("x") is None and common.lenient_int(True) is None
    assert common.clamp_endpoint_ms(25) == 100 and common.clamp_endpoint_ms(10**6) == 5000


def test_words() -> None:
    assert common.split_words("Hello, world!") == ["Hello,", "world!"]
    assert common.split_words("你好。世界") == ["你", "好。", "世", "界"]
    assert common.split_words("用 GPU 跑") == ["用", "GPU", "跑"]
    words = common.spread_words("a bb c", 1000.0, 1600.0)
    assert [(w.text, w.start_ms, w.end_ms) for w in words] == [
        ("a", 1000.0, 1200.0), ("bb", 1200.0, 1400.0), ("c", 1400.0, 1600.0)]  # fmt: skip
    assert common.Word("Hello,", 0, 1, 1.0).bare == "hello"
    assert common.spread_words("", 0, 100) == []
    assert common.join_texts(["hello", " there ", "", "你好", "世界"]) == "hello there你好世界"

"""Offline transcription: the server's own segmentation, one decode path with the worker."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from streamer.offline import transcribe_pcm
from tests.fakes import FakeRecognizer, loudness_classifier, silence, tone


def test_a_failed_decode_is_logged_and_reported_in_its_final(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the second utterance is longer; its decode raises
    pcm = np.concatenate([tone(800), silence(1000), tone(1600), silence(1000)])
    recognizer = FakeRecognizer(fail_when=lambda pcm: pcm.size > 16000 * 1.2)
    with caplog.at_level(logging.ERROR, logger="streamer"):
        finals = list(transcribe_pcm(recognizer, pcm, classifier=loudness_classifier()))
    assert [f.error is None for f in finals] == [True, False]
    assert finals[0].text.startswith("audio")
    assert finals[1].error is not None and finals[1].error["code"] == "decode_failed"
    assert "injected decode failure" not in finals[1].error["message"]  # the log has it
    (record,) = [r for r in caplog.records if "decode failed" in r.getMessage()]
    assert record.exc_info is not None and "injected decode failure" in str(record.exc_info[1])

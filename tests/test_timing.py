"""The suite's scaled clock: eventually() waits for a state and says clearly when it never came."""

from __future__ import annotations

import pytest

from tests.timing import TIMEOUT_FACTOR, eventually, eventually_sync, timeout_s


def test_timeout_s_scales_by_the_factor() -> None:
    assert timeout_s(2.0) == pytest.approx(2.0 * TIMEOUT_FACTOR)


async def test_eventually_returns_once_the_condition_holds() -> None:
    calls = []
    await eventually(lambda: calls.append(1) or len(calls) >= 3)
    assert len(calls) == 3


async def test_eventually_fails_with_the_scaled_bound_in_its_message() -> None:
    with pytest.raises(
        AssertionError,
        match="timed out after .*STREAMER_TESTS_TIMEOUT_FACTOR=.* waiting for the sky",
    ):
        await eventually(lambda: False, 0.05, "the sky")


def test_eventually_sync_fails_and_returns_like_the_async_one() -> None:
    eventually_sync(lambda: True)
    with pytest.raises(AssertionError, match=r"test_timing\.py:\d+"):
        eventually_sync(lambda: False, 0.05)

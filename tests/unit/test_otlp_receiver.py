"""The test OTLP receiver (epd_kit.testing.otlp) as a collector that goes down and comes back on
the URL its exporters hold (tests/real_engines/test_tracing.py's collector-down test)."""

from __future__ import annotations

import httpx
import pytest

from epd_kit.testing.otlp import OtlpReceiver


def post(url: str) -> int:
    return httpx.post(url, content=b"", headers={"content-type": "application/x-protobuf"}, timeout=5).status_code


def test_a_closed_receiver_refuses_and_a_reopened_one_answers_on_the_same_url():
    with OtlpReceiver() as receiver:
        url = receiver.url
        assert post(url) == 200  # an empty export request is a valid one
        receiver.close()
        with pytest.raises(httpx.ConnectError):
            post(url)
        receiver.reopen()
        assert receiver.url == url
        assert post(url) == 200
        assert receiver.posts == 2  # the one before close is kept

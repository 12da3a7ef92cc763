"""The e2e load generator's arrival schedule (tests/e2e/stack.py next_arrival): the rate it is
given is the rate it sends at, and a generator that fell behind does not catch up in a burst."""

from __future__ import annotations

import pytest

from tests.e2e.stack import MAX_LAG_S, next_arrival


def test_arrivals_keep_the_schedule_whatever_each_send_took():
    due, sends = 0.0, []
    for send_took in [0.0, 0.03, 0.01, 0.049, 0.0, 0.02] * 10:  # each under the 0.05 s gap
        sends.append(due)
        due = next_arrival(due, 0.05, now=due + send_took)
    assert sends[-1] == pytest.approx(0.05 * (len(sends) - 1))  # 20/s, not 20/s less the sends' time


def test_a_generator_behind_by_less_than_the_limit_catches_up():
    assert next_arrival(10.0, 0.1, now=10.0 + MAX_LAG_S / 2) == pytest.approx(10.1)


def test_a_generator_far_behind_drops_the_missed_arrivals_instead_of_a_burst():
    now = 10.0 + 5 * MAX_LAG_S
    due = next_arrival(10.0, 0.1, now=now)
    assert due == pytest.approx(now - MAX_LAG_S)
    # from there on at most MAX_LAG_S worth of arrivals are sent at once, then the schedule holds
    burst = 0
    while due <= now:
        burst += 1
        due = next_arrival(due, 0.1, now=now)
    assert burst == pytest.approx(MAX_LAG_S / 0.1, abs=1)

"""The one reconnect backoff (gateway.util.backoff), shared by the adapters and the
replicas' cluster loops."""

from __future__ import annotations

from adapters.base import Backoff as AdapterBackoff
from gateway.util.backoff import Backoff


def test_the_adapters_backoff_is_the_shared_one() -> None:
    assert AdapterBackoff is Backoff


def test_a_loop_retrying_for_hours_keeps_getting_its_cap() -> None:
    """Thousands of attempts (a day of a server down, at a few seconds each) stay at the
    cap: a power of the factor per attempt would overflow a float."""
    backoff = Backoff(initial=0.1, maximum=5.0, jitter=0)
    delays = [backoff.delay() for _ in range(5_000)]
    assert delays[:3] == [0.1, 0.2, 0.4] and delays[-1] == 5.0
    assert backoff.attempt == 5_000


def test_jitter_spreads_each_delay_around_its_base() -> None:
    backoff = Backoff(initial=1.0, maximum=1.0, jitter=0.2)
    delays = [backoff.delay() for _ in range(200)]
    assert all(0.8 <= delay <= 1.2 for delay in delays)
    assert len(set(delays)) > 1

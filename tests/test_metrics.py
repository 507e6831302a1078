"""`/metrics` as prometheus_client writes it: every digit of a counter, the process's own
metrics, one registry per runner."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.ops.metrics import LATENCY_BUCKETS, Metrics


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, parsed as Prometheus would."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_counters_past_a_million_keep_every_digit() -> None:
    metrics = Metrics()
    metrics.turns_total = 1_234_567
    metrics.replies_sent_total = 98_765_432_109
    for status, count in (("ok", 7_654_321), ("failed", 1_000_001)):
        metrics.schedule_runs[status] = count
    metrics.latency_counts[0] = 2_345_678  # the first bucket
    metrics.latency_counts[-1] = 3  # beyond the last bound
    metrics.latency_sum = 12_345.678901
    got = samples(metrics.render())
    assert got[("hermes_turns_total", ())] == 1_234_567
    assert got[("hermes_replies_sent_total", ())] == 98_765_432_109
    assert got[("hermes_schedule_runs_total", (("status", "ok"),))] == 7_654_321
    assert got[("hermes_schedule_runs_total", (("status", "failed"),))] == 1_000_001
    first = (("le", f"{LATENCY_BUCKETS[0]}"),)
    assert got[("hermes_turn_latency_seconds_bucket", first)] == 2_345_678
    assert got[("hermes_turn_latency_seconds_bucket", (("le", "+Inf"),))] == 2_345_681
    assert got[("hermes_turn_latency_seconds_count", ())] == 2_345_681
    assert got[("hermes_turn_latency_seconds_sum", ())] == 12_345.678901


def test_process_metrics_come_with_the_counters() -> None:
    got = samples(Metrics().render())
    names = {name for name, _ in got}
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total"} <= names
    assert got[("process_open_fds", ())] >= 3  # stdin, stdout, stderr at least
    assert got[("process_resident_memory_bytes", ())] > 1_000_000


def test_each_metrics_has_its_own_registry() -> None:
    one, other = Metrics(), Metrics(gauges=lambda: {"active_turns": ("Running turns", 2)})
    one.turns_total, other.turns_total = 5, 7
    got_one, got_other = samples(one.render()), samples(other.render())
    assert got_one[("hermes_turns_total", ())] == 5
    assert got_other[("hermes_turns_total", ())] == 7
    assert ("hermes_active_turns", ()) not in got_one
    assert got_other[("hermes_active_turns", ())] == 2

"""Gateway counters and the Prometheus text exposition of them (`GET /metrics`)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field

# Schedule fire delay buckets in seconds (fire time -> the run's turn begun).
DELAY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
SCHEDULE_RUN_STATUSES = ("ok", "failed", "missed", "interrupted", "undeliverable")

# Turn latency buckets in seconds: echo turns take milliseconds, model turns seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass
class Metrics:
    turns_total: int = 0
    turn_errors_total: int = 0
    turn_timeouts_total: int = 0
    turns_cancelled_total: int = 0
    messages_received_total: int = 0
    messages_refused_total: int = 0
    messages_unavailable_total: int = 0  # not accepted: the store could not write
    commands_total: int = 0
    replies_sent_total: int = 0
    send_errors_total: int = 0
    stream_edits_total: int = 0  # interim edits of streamed replies (issue 18)
    stream_flood_waits_total: int = 0  # 429s that made a stream skip its edits
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0
    schedule_runs: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(SCHEDULE_RUN_STATUSES, 0)
    )
    delay_counts: list[int] = field(default_factory=lambda: [0] * (len(DELAY_BUCKETS) + 1))
    delay_sum: float = 0.0

    def count_schedule_run(self, status: str) -> None:
        self.schedule_runs[status] = self.schedule_runs.get(status, 0) + 1

    def observe_schedule_delay(self, seconds: float) -> None:
        self.delay_counts[bisect_left(DELAY_BUCKETS, seconds)] += 1
        self.delay_sum += seconds

    def observe_turn(self, seconds: float) -> None:
        self.latency_counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """Prometheus text format; `gauges` maps name -> (help, current value)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, value: float) -> None:
            lines.append(f"# HELP hermes_{name} {help_text}")
            lines.append(f"# TYPE hermes_{name} {kind}")
            lines.append(f"hermes_{name} {value:g}")

        counters: list[tuple[str, str, Callable[[], int]]] = [
            ("turns_total", "Agent turns completed", lambda: self.turns_total),
            ("turn_errors_total", "Agent turns that failed", lambda: self.turn_errors_total),
            ("turn_timeouts_total", "Agent turns that timed out", lambda: self.turn_timeouts_total),
            (
                "turns_cancelled_total",
                "Turns cancelled (/stop, /new)",
                lambda: self.turns_cancelled_total,
            ),
            ("messages_received_total", "Inbound messages", lambda: self.messages_received_total),
            (
                "messages_refused_total",
                "Inbound messages refused",
                lambda: self.messages_refused_total,
            ),
            (
                "messages_unavailable_total",
                "Inbound messages not accepted because the store could not write",
                lambda: self.messages_unavailable_total,
            ),
            ("commands_total", "Chat commands handled", lambda: self.commands_total),
            ("replies_sent_total", "Reply chunks delivered", lambda: self.replies_sent_total),
            (
                "send_errors_total",
                "Reply chunks that failed to send",
                lambda: self.send_errors_total,
            ),
            (
                "stream_edits_total",
                "Interim edits of streamed replies",
                lambda: self.stream_edits_total,
            ),
            (
                "stream_flood_waits_total",
                "Flood waits (429) that made streamed replies skip edits",
                lambda: self.stream_flood_waits_total,
            ),
        ]
        for name, help_text, value in counters:
            metric(name, "counter", help_text, value())
        lines.append("# HELP hermes_schedule_runs_total Scheduled runs ended, by status")
        lines.append("# TYPE hermes_schedule_runs_total counter")
        for status, count in self.schedule_runs.items():
            lines.append(f'hermes_schedule_runs_total{{status="{status}"}} {count}')
        _histogram(
            lines,
            "schedule_fire_delay_seconds",
            "Time from a schedule's fire time to its run's turn begun",
            DELAY_BUCKETS,
            self.delay_counts,
            self.delay_sum,
        )
        _histogram(
            lines,
            "turn_latency_seconds",
            "Time from a turn's start to its reply being recorded (queueing behind an"
            " earlier turn of the session not included)",
            LATENCY_BUCKETS,
            self.latency_counts,
            self.latency_sum,
        )
        for name, (help_text, value) in gauges.items():
            metric(name, "gauge", help_text, value)
        return "\n".join(lines) + "\n"


def _histogram(
    lines: list[str],
    name: str,
    help_text: str,
    bounds: tuple[float, ...],
    counts: list[int],
    total: float,
) -> None:
    lines.append(f"# HELP hermes_{name} {help_text}")
    lines.append(f"# TYPE hermes_{name} histogram")
    cumulative = 0
    for bound, count in zip(bounds, counts, strict=False):
        cumulative += count
        lines.append(f'hermes_{name}_bucket{{le="{bound:g}"}} {cumulative}')
    cumulative += counts[-1]
    lines.append(f'hermes_{name}_bucket{{le="+Inf"}} {cumulative}')
    lines.append(f"hermes_{name}_sum {total:g}")
    lines.append(f"hermes_{name}_count {cumulative}")

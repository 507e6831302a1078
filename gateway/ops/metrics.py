"""Gateway counters and the Prometheus text exposition of them (`GET /metrics`)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field

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
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0

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
        ]
        for name, help_text, value in counters:
            metric(name, "counter", help_text, value())
        lines.append(
            "# HELP hermes_turn_latency_seconds Time from a turn's start to its reply being"
            " recorded (queueing behind an earlier turn of the session not included)"
        )
        lines.append("# TYPE hermes_turn_latency_seconds histogram")
        cumulative = 0
        for bound, count in zip(LATENCY_BUCKETS, self.latency_counts, strict=False):
            cumulative += count
            lines.append(f'hermes_turn_latency_seconds_bucket{{le="{bound:g}"}} {cumulative}')
        cumulative += self.latency_counts[-1]
        lines.append(f'hermes_turn_latency_seconds_bucket{{le="+Inf"}} {cumulative}')
        lines.append(f"hermes_turn_latency_seconds_sum {self.latency_sum:g}")
        lines.append(f"hermes_turn_latency_seconds_count {cumulative}")
        for name, (help_text, value) in gauges.items():
            metric(name, "gauge", help_text, value)
        return "\n".join(lines) + "\n"

"""Gateway counters and the Prometheus text exposition of them (`GET /metrics`).

Each runner has its own prometheus_client registry (`Metrics.registry`): two runners in
one process (tests, a CLI beside a daemon) never share or collide on a metric.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from config import LIMIT_NAMES

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
    stream_edits_total: int = 0  # interim edits of streamed replies
    stream_flood_waits_total: int = 0  # 429s that made a stream skip its edits
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0
    schedule_runs: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(SCHEDULE_RUN_STATUSES, 0)
    )
    delay_counts: list[int] = field(default_factory=lambda: [0] * (len(DELAY_BUCKETS) + 1))
    delay_sum: float = 0.0
    #: agent tasks ended, by (agent, terminal state)
    a2a_tasks: dict[tuple[str, str], int] = field(default_factory=dict)
    #: `agent_call` delegations ended: (agent, delegate, outcome) -> count
    delegations: dict[tuple[str, str, str], int] = field(default_factory=dict)
    #: model tokens charged, by (agent, model, direction: input or output)
    model_tokens: dict[tuple[str, str, str], int] = field(default_factory=dict)
    #: model cost charged in USD, by (agent, model)
    model_cost: dict[tuple[str, str], float] = field(default_factory=dict)
    #: turns refused by a budget, by the limit that refused them (every limit from 0)
    budget_refusals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LIMIT_NAMES, 0))
    #: the runner's gauges, read at scrape time: name -> (help, current value)
    gauges: Callable[[], dict[str, tuple[str, float]]] = field(default=dict, repr=False)
    #: the MCP tool servers' health, read at scrape time: name -> {state, tools, last_error}
    tool_servers: Callable[[], dict[str, dict[str, Any]]] = field(default=dict, repr=False)
    registry: CollectorRegistry = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Families(self))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes and kin

    def count_schedule_run(self, status: str) -> None:
        self.schedule_runs[status] = self.schedule_runs.get(status, 0) + 1

    def count_a2a_task(self, agent: str, state: str) -> None:
        self.a2a_tasks[agent, state] = self.a2a_tasks.get((agent, state), 0) + 1

    def count_delegation(self, agent: str, delegate: str, outcome: str) -> None:
        key = (agent, delegate, outcome)
        self.delegations[key] = self.delegations.get(key, 0) + 1

    def count_usage(
        self, agent: str, model: str, input_tokens: int, output_tokens: int, cost: float
    ) -> None:
        tokens = self.model_tokens
        tokens[agent, model, "input"] = tokens.get((agent, model, "input"), 0) + input_tokens
        tokens[agent, model, "output"] = tokens.get((agent, model, "output"), 0) + output_tokens
        self.model_cost[agent, model] = self.model_cost.get((agent, model), 0.0) + cost

    def count_budget_refusal(self, limit: str) -> None:
        self.budget_refusals[limit] = self.budget_refusals.get(limit, 0) + 1

    def observe_schedule_delay(self, seconds: float) -> None:
        self.delay_counts[bisect_left(DELAY_BUCKETS, seconds)] += 1
        self.delay_sum += seconds

    def observe_turn(self, seconds: float) -> None:
        self.latency_counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds

    def render(self) -> str:
        """Prometheus text format (0.0.4): these counters, the runner's gauges and the
        process's own metrics (RSS, CPU, open fds), written by prometheus_client, which
        keeps every digit of a counter (`{:g}` kept six)."""
        return generate_latest(self.registry).decode("utf-8")

    def families(self) -> Iterator[Metric]:
        """The families as they are now: read at scrape time, so counting stays a plain
        integer increment on the turn's path (a prometheus_client Counter takes a lock
        per increment)."""
        for name, help_text in _COUNTERS:
            yield CounterMetricFamily(f"hermes_{name}", help_text, value=getattr(self, name))
        runs = CounterMetricFamily(
            "hermes_schedule_runs_total", "Scheduled runs ended, by status", labels=["status"]
        )
        for status, count in self.schedule_runs.items():
            runs.add_metric([status], count)
        yield runs
        tasks = CounterMetricFamily(
            "hermes_a2a_tasks_total",
            "Agent tasks (A2A) ended, by agent and state",
            labels=["agent", "state"],
        )
        for (agent, state), count in self.a2a_tasks.items():
            tasks.add_metric([agent, state], count)
        yield tasks
        delegations = CounterMetricFamily(
            "hermes_a2a_delegations_total",
            "agent_call delegations ended, by calling agent, delegate and outcome",
            labels=["agent", "delegate", "outcome"],
        )
        for labels, count in sorted(self.delegations.items()):
            delegations.add_metric(list(labels), count)
        yield delegations
        tokens = CounterMetricFamily(
            "hermes_model_tokens_total",
            "Model tokens charged to turns (as the backend reported them, or estimated),"
            " by agent, model and direction",
            labels=["agent", "model", "direction"],
        )
        for labels, count in sorted(self.model_tokens.items()):
            tokens.add_metric(list(labels), count)
        yield tokens
        cost = CounterMetricFamily(
            "hermes_model_cost_usd_total",
            "Model cost charged to turns in USD (at the models' configured price),"
            " by agent and model",
            labels=["agent", "model"],
        )
        for labels, usd in sorted(self.model_cost.items()):
            cost.add_metric(list(labels), usd)
        yield cost
        refusals = CounterMetricFamily(
            "hermes_budget_refusals_total",
            "Turns refused before the model was called, by the budget limit reached",
            labels=["limit"],
        )
        for limit, count in sorted(self.budget_refusals.items()):
            refusals.add_metric([limit], count)
        yield refusals
        yield _histogram(
            "schedule_fire_delay_seconds",
            "Time from a schedule's fire time to its run's turn begun",
            DELAY_BUCKETS,
            self.delay_counts,
            self.delay_sum,
        )
        yield _histogram(
            "turn_latency_seconds",
            "Time from a turn's start to its reply being recorded (queueing behind an"
            " earlier turn of the session not included)",
            LATENCY_BUCKETS,
            self.latency_counts,
            self.latency_sum,
        )
        for name, (help_text, value) in self.gauges().items():
            yield GaugeMetricFamily(f"hermes_{name}", help_text, value=value)
        servers = self.tool_servers()
        if servers:
            up = GaugeMetricFamily(
                "hermes_mcp_server_up",
                "1 while the MCP tool server is connected, 0 while down or starting",
                labels=["server", "state"],
            )
            tools = GaugeMetricFamily(
                "hermes_mcp_server_tools", "Tools the MCP server offers", labels=["server"]
            )
            for server, health in servers.items():
                up.add_metric([server, health["state"]], int(health["state"] == "up"))
                tools.add_metric([server], health["tools"])
            yield up
            yield tools


class _Families:
    """The registry's collector of a `Metrics` (a dataclass compares by value, so it is
    not hashable and cannot be registered itself)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self.metrics.families()


#: the counters of `Metrics`: attribute (the name after `hermes_`), help text
_COUNTERS: tuple[tuple[str, str], ...] = (
    ("turns_total", "Agent turns completed"),
    ("turn_errors_total", "Agent turns that failed"),
    ("turn_timeouts_total", "Agent turns that timed out"),
    ("turns_cancelled_total", "Turns cancelled (/stop, /new)"),
    ("messages_received_total", "Inbound messages"),
    ("messages_refused_total", "Inbound messages refused"),
    (
        "messages_unavailable_total",
        "Inbound messages not accepted because the store could not write",
    ),
    ("commands_total", "Chat commands handled"),
    ("replies_sent_total", "Reply chunks delivered"),
    ("send_errors_total", "Reply chunks that failed to send"),
    ("stream_edits_total", "Interim edits of streamed replies"),
    ("stream_flood_waits_total", "Flood waits (429) that made streamed replies skip edits"),
)


def _histogram(
    name: str,
    help_text: str,
    bounds: tuple[float, ...],
    counts: list[int],
    total: float,
) -> HistogramMetricFamily:
    buckets: list[tuple[str, float]] = []
    cumulative = 0
    for bound, count in zip(bounds, counts, strict=False):
        cumulative += count
        buckets.append((f"{bound:g}", cumulative))
    buckets.append(("+Inf", cumulative + counts[-1]))
    return HistogramMetricFamily(f"hermes_{name}", help_text, buckets=buckets, sum_value=total)

"""What scripts/load_http.py prints: a fixed-rate run, the saturation table, and the
daemon's own counters (/metrics) and warnings (its log), from the result dicts."""

from __future__ import annotations

from typing import Any

from scripts.harness import bucket_delta, fmt_ms, histogram, histogram_quantile


def print_fixed(result: dict[str, Any]) -> None:
    lat, rtt = result["latency"], result["post_rtt"]
    print(
        f"offered {result['offered_rate']:g} msgs/s for {result['seconds']:g} s over "
        f"{result['chats']} chats: {result['scheduled']} messages"
    )
    print(
        f"sent {result['sent']} ({result['sent_rate']:.1f}/s), shed by the client "
        f"{result['shed']}, client schedule lag p99 {fmt_ms(result['schedule_lag_p99'])} ms"
    )
    cpu = result["cpu_percent"]
    print(
        f"CPU while sending: daemon {cpu['daemon']:.0f}% (event-loop thread "
        f"{cpu['daemon_loop']:.0f}%, and it waited for a CPU {cpu['daemon_loop_runq']:.0f}% "
        f"of the time), this client {cpu['client']:.0f}%"
    )
    print(
        f"accepted {result['accepted']} ({result['accepted_rate']:.1f} msgs/s)  "
        f"refused {result['refused']}  other {result['other_statuses'] or 0}  "
        f"errors {result['errors'] or 0}"
    )
    print(f"POST round trip ms: p50={fmt_ms(rtt['p50'])} p99={fmt_ms(rtt['p99'])}")
    print(
        f"reply latency ms (POST sent -> reply visible to the long-poll): "
        f"p50={fmt_ms(lat['p50'])} p90={fmt_ms(lat['p90'])} p99={fmt_ms(lat['p99'])} "
        f"max={fmt_ms(lat['max'])} ({result['answered']} answered in "
        f"{result['reply_messages']} replies)"
    )
    print(
        f"replies missing: {result['missing']}  duplicated: {result['duplicated']}  "
        f"unexpected: {result['unexpected']}  error replies: {result['error_replies']}  "
        f"poll errors: {result['poll_errors'] or 0}"
    )


def step_ok(result: dict[str, Any], slo: float) -> bool:
    return (
        result["replies_rate"] >= 0.95 * result["offered_rate"] and result["p99_with_missing"] < slo
    )


def print_table(rows: list[dict[str, Any]], slo: float) -> None:
    print(
        f"{'offered/s':>9} {'sent/s':>7} {'shed':>5} {'accepted/s':>10} {'replies/s':>9} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'missing':>7} {'refused':>7} {'errors':>6} "
        f"{'daemon%':>7} {'loop%':>5} {'runq%':>5} {'client%':>7}  ok"
    )
    for r in rows:
        errors = sum(r["errors"].values())
        cpu = r["cpu_percent"]
        print(
            f"{r['offered_rate']:>9g} {r['sent_rate']:>7.0f} {r['shed']:>5} "
            f"{r['accepted_rate']:>10.0f} {r['replies_rate']:>9.0f} "
            f"{fmt_ms(r['p50_with_missing']):>8} {fmt_ms(r['p99_with_missing']):>8} "
            f"{r['missing']:>7} {r['refused']:>7} {errors:>6} {cpu['daemon']:>7.0f} "
            f"{cpu['daemon_loop']:>5.0f} {cpu['daemon_loop_runq']:>5.0f} {cpu['client']:>7.0f}  "
            f"{'yes' if step_ok(r, slo) else 'no'}"
        )
    print(
        "  daemon% = daemon process CPU (100 = one core), loop% = its event-loop thread, "
        "runq% = time that thread was runnable but waiting for a CPU, client% = this "
        "script; all over the send window"
    )


def print_metrics(before: dict[str, float] | None, after: dict[str, float] | None) -> None:
    if after is None:
        print("daemon /metrics: unavailable")
        return
    before = before or {}

    def delta(name: str) -> int:
        return int(after.get(f"hermes_{name}", 0) - before.get(f"hermes_{name}", 0))

    buckets = bucket_delta(
        histogram(after, "hermes_turn_latency_seconds"),
        histogram(before, "hermes_turn_latency_seconds"),
    )
    print(
        f"daemon /metrics (this run): turns={delta('turns_total')} "
        f"messages_received={delta('messages_received_total')} "
        f"refused={delta('messages_refused_total')} turn_errors={delta('turn_errors_total')} "
        f"timeouts={delta('turn_timeouts_total')} replies_sent={delta('replies_sent_total')} "
        f"send_errors={delta('send_errors_total')}; turn latency (daemon's histogram, "
        f"bucket estimate) p50={fmt_ms(histogram_quantile(0.5, buckets))} ms "
        f"p99={fmt_ms(histogram_quantile(0.99, buckets))} ms"
    )


def report_daemon_log(counts: dict[str, int], samples: list[str]) -> None:
    if not counts:
        print("daemon log: no warnings or errors")
        return
    print(f"daemon log: {sum(counts.values())} warning/error lines: {dict(counts)}")
    for sample in samples:
        print(f"  {sample}")

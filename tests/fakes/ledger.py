"""A stand-in for the gateway's delivery ledger, for adapter tests without a runner.

Rows get ids from 1 that only grow (like the `outbound` table); `after()` answers what
`GatewayHandle.replies_after` answers.
"""

from __future__ import annotations

from typing import Any

from gateway.session import SessionSource

REPLY_FIELDS = ("seq", "text", "thread_id", "in_reply_to")


class FakeLedger(list[dict[str, Any]]):
    def record(self, target: SessionSource, text: str, reply_to: str | None = None) -> int:
        seq = len(self) + 1
        self.append(
            {
                "seq": seq,
                "platform": target.platform.value,
                "chat_id": target.chat_id,
                "text": text,
                "thread_id": target.thread_id,
                "in_reply_to": reply_to,
            }
        )
        return seq

    def after(self, platform: str, chat_id: str, after: int, limit: int) -> list[dict[str, Any]]:
        return [
            {key: row[key] for key in REPLY_FIELDS}
            for row in self
            if row["platform"] == platform and row["chat_id"] == chat_id and row["seq"] > after
        ][:limit]

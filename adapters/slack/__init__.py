"""Slack through slack-bolt (see `adapters.slack.adapter` for the flow): the adapter, and
the reading of what Slack sends (`adapters.slack.events`)."""

from adapters.slack.adapter import SlackAdapter, slack_len

__all__ = ["SlackAdapter", "slack_len"]

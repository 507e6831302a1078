"""Agents: the protocol the runner talks to, the per-session cache, the backends."""

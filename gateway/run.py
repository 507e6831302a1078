"""The runner's public name: `from gateway.run import GatewayRunner`.

The runner itself is the package `gateway.runner`: its lifecycle and intake
(`lifecycle`), the turn engine (`engine`, `turn`, `agent_call`), where sessions run
(`placement`: one process, or one replica of several), and the parts each receive a
narrow port of what they call (`ports`).
"""

from gateway.runner.lifecycle import GatewayRunner

__all__ = ["GatewayRunner"]

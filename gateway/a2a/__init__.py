"""The A2A protocol (docs/a2a.md): every agent served as an A2A server on the HTTP API's
port (JSON-RPC, protocol 1.0 and 0.3 clients), its agent card, and the client `agent_call`
reaches remote agents with. The only package that imports the `a2a-sdk`; it reaches the
runner through `gateway.domain.agent_tasks.AgentTasks`."""

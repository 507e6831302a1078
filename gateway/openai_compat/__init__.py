"""The OpenAI-compatible endpoint (`/v1/chat/completions`, `/v1/models`) on the HTTP API's
port (docs/http-api.md): each request one turn of the caller's conversation with an
agent, through the runner's agent tasks (`gateway.domain.agent_tasks.AgentTasks`)."""

"""An agent's A2A card, from its config: what other agents read before they call it.

One JSON-RPC endpoint per agent (`<base>/a2a/<agent>`) serves protocol 1.0 and 0.3, so
the card names it twice, once per version. Served as the SDK's `agent_card_to_dict`
serves it: the 1.0 card with the 0.3 fields merged in (`url`, `protocolVersion`,
`preferredTransport`, ...), so a 0.3 client reads the same document.
"""

from __future__ import annotations

from typing import Any

from a2a.server.request_handlers.response_helpers import agent_card_to_dict
from a2a.types import a2a_pb2 as pb
from a2a.utils.constants import PROTOCOL_VERSION_0_3, PROTOCOL_VERSION_1_0, TransportProtocol

from config import MAIN_AGENT, GatewayConfig

__all__ = ["BEARER_SCHEME", "agent_path", "build_card", "card_json"]

BEARER_SCHEME = "bearer"
TEXT = "text/plain"


def agent_path(agent_id: str) -> str:
    return f"/a2a/{agent_id}"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hermes-gateway")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0"


def build_card(config: GatewayConfig, agent_id: str, base_url: str) -> pb.AgentCard:
    """`base_url`: where this gateway is reached (`a2a.public_url`, else the HTTP API's
    own address), without a trailing slash."""
    agent = config.agent_configs()[agent_id]
    url = base_url + agent_path(agent_id)
    name = "hermes" if agent_id == MAIN_AGENT else f"hermes {agent_id}"
    description = agent.description or f"The hermes-gateway agent {agent_id!r}."
    card = pb.AgentCard(
        name=name,
        description=description,
        version=_version(),
        supported_interfaces=[
            pb.AgentInterface(
                url=url,
                protocol_binding=TransportProtocol.JSONRPC,
                protocol_version=version,
            )
            for version in (PROTOCOL_VERSION_1_0, PROTOCOL_VERSION_0_3)
        ],
        capabilities=pb.AgentCapabilities(streaming=True, push_notifications=False),
        default_input_modes=[TEXT],
        default_output_modes=[TEXT],
        skills=[
            pb.AgentSkill(
                id=skill.id,
                name=skill.name,
                description=skill.description or skill.name,
                tags=skill.tags or [skill.id],
                examples=skill.examples,
                input_modes=[TEXT],
                output_modes=[TEXT],
            )
            for skill in agent.skills
        ]
        or [_conversation_skill(description)],
    )
    if config.platforms.http.token:
        card.security_schemes[BEARER_SCHEME].http_auth_security_scheme.CopyFrom(
            pb.HTTPAuthSecurityScheme(
                scheme="Bearer",
                description="platforms.http.token of the gateway, as Authorization: Bearer",
            )
        )
        requirement = card.security_requirements.add()
        requirement.schemes[BEARER_SCHEME].SetInParent()
    return card


def _conversation_skill(description: str) -> pb.AgentSkill:
    """The skill a card names when the config lists none (the spec requires one)."""
    return pb.AgentSkill(
        id="conversation",
        name="Conversation",
        description=description,
        tags=["chat"],
        input_modes=[TEXT],
        output_modes=[TEXT],
    )


def card_json(card: pb.AgentCard) -> dict[str, Any]:
    return agent_card_to_dict(card)

"""The domain: what a message and a session are, independent of storage and transport.

The session model and its keys, the reset policy, routing to an agent, the chat-command
syntax, attachments and the inbound message event. Nothing here does I/O; everything
above (store, runner, adapters) imports it, and it imports only `config`.
"""

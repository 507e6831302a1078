"""The runner in parts: lifecycle and intake, the turn engine, placement (local or
replica), and the parts beside the turns (commands, recovery, housekeeping, delivery,
streaming, media, pairing). `gateway.run` is the public door (`GatewayRunner`)."""

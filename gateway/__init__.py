"""hermes-gateway core: sessions, store, runner, recovery, commands, agents."""

"""hermes-gateway core: the runner and the domain; the store, agents and ops in packages."""

"""Small helpers with no gateway knowledge: durable file writes, crash-point faults, and
PostgreSQL channel names and lock keys scoped to a schema."""

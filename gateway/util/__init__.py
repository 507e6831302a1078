"""Small helpers with no gateway knowledge: durable file writes and crash-point faults."""

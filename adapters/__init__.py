"""Platform adapters: one module per platform plus the common base."""

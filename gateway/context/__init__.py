"""What a turn sends the model: token estimates and the context strategies (pure code)."""

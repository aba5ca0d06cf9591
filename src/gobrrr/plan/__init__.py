"""Plan the fastest training configuration that fits, and apply it."""

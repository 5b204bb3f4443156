"""Ready-made machines with their handlers and service protocols, built on the public API."""

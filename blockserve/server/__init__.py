"""The OpenAI-compatible HTTP server: app factory, protocol models, errors, metrics, auth."""

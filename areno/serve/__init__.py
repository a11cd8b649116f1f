"""Ray Serve deployments behind an OpenAI-compatible route (`areno serve`)."""

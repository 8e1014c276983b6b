"""The HTTP face of the engine: an OpenAI-compatible server (`kvlm serve`), importing only the public engine API."""

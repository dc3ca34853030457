"""A block-level emulator of vLLM's V1 engine behind an OpenAI-compatible server (see README.md)."""

"""The LLM port: a small protocol, an OpenAI-compatible client and the offline demo model."""

"""Tools the agent may call: the registry, the built-ins and the MCP adapter."""

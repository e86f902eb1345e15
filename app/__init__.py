"""AgentStream: run tool-using LLM agents and stream their work as Server-Sent Events."""

__version__ = "0.1.0"

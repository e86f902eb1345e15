"""Benchmarks of AgentStream against its peers; see bench/README.md."""

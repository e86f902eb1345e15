"""The A2A face (FACES.md N-01..N-08): other agents hand AgentStream tasks over A2A 1.0 (and 0.3).

- ``card``: the agent card; ``routes``: the card, JSON-RPC and HTTP+JSON routes around the SDK's
  dispatchers; ``handler``: the A2A methods on runs; ``requests``: what a message means;
  ``translate``: a run's events as the task's stream; ``tasks``: tasks as the database holds them.
"""

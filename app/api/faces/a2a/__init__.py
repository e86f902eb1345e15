"""The A2A face (FACES.md N-01..N-08): other agents hand AgentStream tasks over A2A 1.0 (and 0.3).

- ``routes``: the card, JSON-RPC and HTTP+JSON routes (``paths``: where they are), loading the SDK
  on the first request that needs it; ``card``: the agent card; ``bindings``: the SDK's dispatchers
  behind the service's auth and checks; ``handler``: the A2A methods on runs; ``requests``: what a
  message means; ``translate``: a run's events as the task's stream; ``tasks``: tasks as the
  database holds them.
"""

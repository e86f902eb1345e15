"""Where the A2A face listens: the card's two paths, the JSON-RPC endpoint and the HTTP+JSON base.

Apart from the face's other modules, which load the SDK: the routes are declared with these at
import, the SDK loaded on the first request that needs it (``routes``)."""

JSONRPC_PATH = "/a2a"
"""The JSON-RPC endpoint (also with a trailing slash: the TCK posts there)."""
REST_PATH = "/a2a/rest"
"""The HTTP+JSON binding's base: ``/a2a/rest/message:send``, ``/a2a/rest/tasks/{id}``, ... (its 0.3
routes under ``/a2a/rest/v1/...``, where 0.3 clients put them)."""
CARD_PATH = "/.well-known/agent-card.json"
"""The 1.0 card."""
LEGACY_CARD_PATH = "/.well-known/agent.json"
"""The same card with the 0.3 fields, for older clients."""

"""The HTTP face of the service: routes, request/response schemas, dependencies, error mapping."""

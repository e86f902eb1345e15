"""The AG-UI face: ``POST /api/ag-ui`` (FACES.md G-01..G-05, docs/faces-protocols.md D3)."""

"""The two-phase ReAct engine: pure asyncio, no HTTP, no Redis, no SQL."""

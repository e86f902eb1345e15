"""The event transport: buses (in-process, Redis Streams), SSE encoding, resume cursors."""

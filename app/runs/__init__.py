"""The run manager: runs as background tasks, leases and heartbeat, cancel, the reaper, shutdown."""

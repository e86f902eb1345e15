"""Peer frameworks doing the benchmark job; they run in bench/.venv-peers (peers/setup.sh)."""

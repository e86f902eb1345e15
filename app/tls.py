"""The TLS context of the service's outgoing HTTPS clients: one per process.

Building one loads the CA bundle, some 20 ms of CPU; the LLM client, the webhook deliverer and the
signing-key fetcher each built their own at every start of the app (every worker, every test
server). A context is safe to share between connections, clients and threads; it is made on first
use, so it sees the environment (``SSL_CERT_FILE``, ``SSL_CERT_DIR``) as the process has it then.
"""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def client_tls() -> ssl.SSLContext:
    """httpx's default context (certificate and host name checked against the CA bundle)."""
    return httpx.create_ssl_context()

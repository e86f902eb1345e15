"""A local identity provider for the sign-in tests (FACES.md J-01..J-04): real HTTP on 127.0.0.1.

``IdentityProvider`` serves an OpenID Connect discovery document
(``/realms/test/.well-known/openid-configuration``) and a JWK set (``/realms/test/jwks``) from a
thread, with keys generated here (RSA, P-256, Ed25519) and tokens signed here with PyJWT, as a real
provider signs them. It counts the JWK set's fetches (``jwks_fetches``, ``wait_fetches(n)``), can be
stopped and started again on its port (the provider down), can take requests and never answer
them (``hang()``: a provider stuck behind its load balancer), and publishes whatever keys a test
says (rotation). ``forge`` makes what no provider would: ``alg: none``, HS256 keyed with the public
key, any header or signature.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

from tests.support.ports import free_port

AUDIENCE = "https://agentstream.test/api"
REALM = "/realms/test"


@dataclass(frozen=True)
class SigningKey:
    kid: str
    alg: str
    private: Any

    def jwk(self) -> dict[str, Any]:
        public = self.private.public_key()
        exporter: Any = {"RS256": RSAAlgorithm, "ES256": ECAlgorithm, "EdDSA": OKPAlgorithm}[self.alg]
        return {**exporter.to_jwk(public, as_dict=True), "kid": self.kid, "use": "sig", "alg": self.alg}

    def public_pem(self) -> bytes:
        return bytes(
            self.private.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )


def new_key(alg: str = "RS256", kid: str | None = None) -> SigningKey:
    private: Any
    if alg == "RS256":
        private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    elif alg == "ES256":
        private = ec.generate_private_key(ec.SECP256R1())
    elif alg == "EdDSA":
        private = ed25519.Ed25519PrivateKey.generate()
    else:
        raise ValueError(alg)
    return SigningKey(kid or f"{alg.lower()}-{secrets.token_hex(4)}", alg, private)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def forge(header: dict[str, Any], claims: dict[str, Any], sign: Any = None) -> str:
    """A compact JWS from ``header`` and ``claims``; ``sign(signing_input) -> bytes`` (none: empty)."""
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
    signature = sign(signing_input.encode()) if sign is not None else b""
    return f"{signing_input}.{_b64(signature)}"


def hs256_with(secret: bytes) -> Any:
    return lambda data: hmac.new(secret, data, hashlib.sha256).digest()


class IdentityProvider:
    """See the module docstring. ``start()``/``stop()``, or use it as a context manager."""

    def __init__(self, port: int | None = None, *, audience: str = AUDIENCE) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.issuer = f"{self.base_url}{REALM}"
        self.jwks_url = f"{self.issuer}/jwks"
        self.audience = audience
        self.key = new_key("RS256")
        self._published: list[SigningKey] = [self.key]
        self._fetches = 0
        self._discoveries = 0
        self._held = 0
        self._hanging = False
        self._hung_up = threading.Event()
        self._changed = threading.Condition()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- what the service is told ----------------------------------------------------------------

    def settings(self, *, discovery: bool = False) -> dict[str, Any]:
        """The service's settings for this provider: its JWKS URL (or its discovery) and audience."""
        if discovery:
            return {"auth_oidc_issuer": self.issuer, "auth_jwt_audience": self.audience}
        return {
            "auth_jwt_jwks_url": self.jwks_url,
            "auth_jwt_issuer": self.issuer,
            "auth_jwt_audience": self.audience,
        }

    def env(self) -> dict[str, str]:
        return {name.upper(): str(value) for name, value in self.settings().items()}

    # -- keys and tokens -------------------------------------------------------------------------

    @property
    def published(self) -> dict[str, SigningKey]:
        """The keys the JWK set serves, by algorithm (the first of each)."""
        out: dict[str, SigningKey] = {}
        for key in self._published:
            out.setdefault(key.alg, key)
        return out

    def publish(self, *keys: SigningKey) -> None:
        """The JWK set serves these keys from now on (and no other)."""
        self._published = list(keys)

    def claims(self, sub: str | None = "user-a", lifetime_s: float = 300, **extra: Any) -> dict[str, Any]:
        now = int(time.time())
        out: dict[str, Any] = {
            "iss": self.issuer,
            "aud": self.audience,
            "iat": now,
            "exp": now + int(lifetime_s),
        }
        if sub is not None:
            out["sub"] = sub
        out.update(extra)
        return {name: value for name, value in out.items() if value is not None}

    def token(
        self,
        sub: str | None = "user-a",
        *,
        key: SigningKey | None = None,
        headers: dict[str, Any] | None = None,
        lifetime_s: float = 300,
        **claims: Any,
    ) -> str:
        """A token signed as the provider signs (``key``: the first published one); a claim passed
        as None is left out."""
        key = key or self._published[0]
        return jwt.encode(
            self.claims(sub, lifetime_s, **claims),
            key.private,
            algorithm=key.alg,
            headers={"kid": key.kid, "typ": "at+jwt", **(headers or {})},
        )

    # -- fetches ---------------------------------------------------------------------------------

    @property
    def jwks_fetches(self) -> int:
        with self._changed:
            return self._fetches

    @property
    def discoveries(self) -> int:
        with self._changed:
            return self._discoveries

    @property
    def held(self) -> int:
        """Requests taken while hanging (and never answered)."""
        with self._changed:
            return self._held

    def hang(self) -> None:
        """From now on every request is taken and never answered: its connection stays open, with
        no byte of an answer, until ``stop()`` (which closes it)."""
        self._hung_up.clear()
        self._hanging = True

    def wait_fetches(self, count: int, timeout: float = 10.0) -> None:
        """Waits until the JWK set was fetched at least ``count`` times."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._fetches >= count, timeout=timeout):
                raise AssertionError(
                    f"the JWK set was fetched {self._fetches} times, not {count}, in {timeout}s"
                )

    # -- serving ---------------------------------------------------------------------------------

    def start(self) -> IdentityProvider:
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if provider._hanging:
                    with provider._changed:
                        provider._held += 1
                        provider._changed.notify_all()
                    provider._hung_up.wait(timeout=120)  # bounded, should stop() never come
                    self.close_connection = True
                    return
                if self.path == f"{REALM}/.well-known/openid-configuration":
                    body: Any = {
                        "issuer": provider.issuer,
                        "jwks_uri": provider.jwks_url,
                        "authorization_endpoint": f"{provider.issuer}/auth",
                        "token_endpoint": f"{provider.issuer}/token",
                        "id_token_signing_alg_values_supported": ["RS256", "ES256", "EdDSA"],
                    }
                    counter = "_discoveries"
                elif self.path == f"{REALM}/jwks":
                    body = {"keys": [k.jwk() for k in provider._published]}
                    counter = "_fetches"
                else:
                    self.send_error(404)
                    return
                # Counted before the answer goes out: once the service has it, the count says so.
                with provider._changed:
                    setattr(provider, counter, getattr(provider, counter) + 1)
                    provider._changed.notify_all()
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Down: connections to its port are refused until ``start()``; requests it holds (``hang()``)
        are let go, unanswered."""
        self._hanging = False
        self._hung_up.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> IdentityProvider:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

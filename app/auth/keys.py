"""The identity provider's signing keys (FACES.md J-01, J-02): fetched, cached, fetched again rarely.

``SigningKeys`` reads the provider's JWK set, from ``AUTH_JWT_JWKS_URL`` or from the ``jwks_uri``
of ``AUTH_OIDC_ISSUER``'s discovery document, over httpx (async: the event loop never waits on it):

- a background task loads the keys at start, and tries again with back-off while the provider is
  down, so the service starts regardless; once loaded it refreshes them every ``REFRESH_S``, so a
  key the provider withdrew stops being accepted;
- a token whose ``kid`` is not cached fetches the set again, at most once per ``refetch_s`` (30 s)
  however many such tokens come: a rotated key is found without a restart, forged kids cause no
  refetch storm;
- a fetch that fails keeps the keys already cached: tokens keep working while the provider is down.

Fetches never overlap: whoever needs one while one is under way waits for that one, but a request
waits at most ``REQUEST_WAIT_S`` (a provider that takes connections and never answers holds no
request for the fetch's own timeout). Only public RS256, ES256 and EdDSA keys that have a ``kid``
are kept, by ``kid`` and algorithm. Keys come over https only (plain http to a loopback host
aside), redirects are not followed, and a discovery document naming an http ``jwks_uri`` is
refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import httpx
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey
from jwt import PyJWK

from app.observability import Metrics
from app.settings import fetchable_url
from app.tls import client_tls

log = logging.getLogger("app.auth")

ALGORITHMS = ("RS256", "ES256", "EdDSA")
"""The only signature algorithms taken (J-02): never ``none``, never an HMAC one."""
REFRESH_S = 600.0
"""How often loaded keys are fetched again (a withdrawn key is refused from then on)."""
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 60.0
"""Back-off of the background task's tries while the provider cannot be reached."""
FETCH_TIMEOUT_S = 10.0
REQUEST_WAIT_S = 2.0
"""The longest a request waits for a fetch of the keys (the fetch itself goes on for the others)."""
MAX_DOCUMENT_BYTES = 512 * 1024
MIN_RSA_BITS = 2048
_PRIVATE_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "k"})

KeyState = Literal["ok", "stale", "not_loaded"]


class KeysNotLoadedError(Exception):
    """No key could be loaded yet: a token can be neither taken nor refused for its signature."""


class UnknownKeyError(Exception):
    """The provider publishes no key of that ``kid`` (as far as the rate of refetches lets us know)."""


class _FetchError(Exception):
    pass


KeySet = dict[str, dict[str, PyJWK]]
"""The signing keys by ``kid``, then by algorithm: RFC 7517 4.5 lets keys of different types share
a ``kid``, and a token's header names both."""


def usable_keys(document: Any) -> KeySet:
    """The signing keys of a JWK set by ``kid`` and algorithm: public RS256 (2048 bits or more),
    ES256 or EdDSA. A key PyJWK cannot load is skipped, not the set; of keys with the same ``kid``
    and algorithm the first is taken (a warning says so)."""
    if not isinstance(document, Mapping) or not isinstance(document.get("keys"), list):
        raise _FetchError("the document is not a JWK set (no 'keys' list)")
    keys: KeySet = {}
    for jwk in document["keys"]:
        if not isinstance(jwk, dict) or not isinstance(jwk.get("kid"), str) or not jwk["kid"]:
            continue
        kid: str = jwk["kid"]
        if jwk.get("use", "sig") != "sig" or jwk.get("kty") == "oct" or _PRIVATE_MEMBERS & jwk.keys():
            continue  # an encryption key, a shared secret, or a private key published by mistake
        try:
            key = PyJWK(jwk)
        except Exception:
            # A key type or curve this service does not take (PyJWTError), or one PyJWK fails on
            # otherwise ("alg": "none" raises NotImplementedError): that key only is left out.
            log.info("a key of the JWK set is skipped: it cannot be loaded", extra={"kid": kid[:100]})
            continue
        if key.algorithm_name not in ALGORITHMS:
            continue
        if isinstance(key.key, RSAPublicKey) and key.key.key_size < MIN_RSA_BITS:
            continue
        of_kid = keys.setdefault(kid, {})
        if key.algorithm_name in of_kid:
            log.warning(
                "the JWK set holds two keys of the same kid and algorithm: the first is taken",
                extra={"kid": kid[:100], "alg": key.algorithm_name},
            )
            continue
        of_kid[key.algorithm_name] = key
    if not keys:
        raise _FetchError("the JWK set holds no usable signing key (RS256, ES256 or EdDSA, with a kid)")
    return keys


class SigningKeys:
    """See the module docstring. ``start()`` in the app's lifespan, ``aclose()`` when it ends."""

    def __init__(
        self,
        *,
        jwks_url: str | None,
        oidc_issuer: str | None = None,
        refetch_s: float = 30.0,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not jwks_url and not oidc_issuer:
            raise ValueError("SigningKeys needs a JWKS URL or an OIDC issuer")
        self._jwks_url = jwks_url
        self._oidc_issuer = oidc_issuer
        self._discovered_issuer: str | None = None
        self._refetch_s = refetch_s
        self._metrics = metrics
        self._clock = clock
        for url in (jwks_url, oidc_issuer):
            if url and not fetchable_url(url):
                raise ValueError(f"signing keys come over https only (http to a loopback host aside): {url}")
        self._http = httpx.AsyncClient(
            transport=transport,
            timeout=FETCH_TIMEOUT_S,
            # A redirect could lead to plain http or to another host: an answer other than 200
            # is a failed fetch.
            follow_redirects=False,
            headers={"Accept": "application/json"},
            verify=client_tls(),
        )
        self._keys: KeySet = {}
        self._last_fetch_ok = False
        self._last_refetch: float | None = None
        self._inflight: asyncio.Task[bool] | None = None
        self._task: asyncio.Task[None] | None = None

    # -- what the verifier and /readyz ask -------------------------------------------------------

    @property
    def issuer(self) -> str | None:
        """The issuer the discovery document names, else ``AUTH_OIDC_ISSUER`` (None without it)."""
        return self._discovered_issuer or self._oidc_issuer

    @property
    def state(self) -> KeyState:
        """``ok``: keys loaded, the last fetch worked; ``stale``: cached keys in use, the last
        fetch failed; ``not_loaded``: no key could be loaded yet."""
        if not self._keys:
            return "not_loaded"
        return "ok" if self._last_fetch_ok else "stale"

    async def key(self, kid: str, alg: str | None = None) -> PyJWK:
        """The key of ``kid`` for ``alg`` (if ``kid`` names none for ``alg``, one of another: the
        caller refuses its algorithm); fetches the set again if ``kid`` is unknown and no refetch
        was made in the last ``refetch_s``, waiting for it at most ``REQUEST_WAIT_S``. Raises
        ``UnknownKeyError``, or ``KeysNotLoadedError`` while none is."""
        key = self._pick(kid, alg)
        if key is not None:
            return key
        now = self._clock()
        if self._last_refetch is None or now - self._last_refetch >= self._refetch_s:
            self._last_refetch = now
            self._start_fetch()
        # A fetch under way (a rotated key's first tokens come together) decides, if it is quick.
        await self._wait_fetch()
        key = self._pick(kid, alg)
        if key is not None:
            return key
        if not self._keys:
            raise KeysNotLoadedError
        raise UnknownKeyError

    def _pick(self, kid: str, alg: str | None) -> PyJWK | None:
        of_kid = self._keys.get(kid)
        if not of_kid:
            return None
        return of_kid.get(alg or "") or next(iter(of_kid.values()))

    async def _wait_fetch(self) -> None:
        """Waits for the fetch under way, if any, at most ``REQUEST_WAIT_S``: it goes on after."""
        inflight = self._inflight
        if inflight is None or inflight.done():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(inflight), REQUEST_WAIT_S)

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._keep_loaded(), name="signing-keys")

    async def aclose(self) -> None:
        for task in (self._task, self._inflight):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._http.aclose()

    async def _keep_loaded(self) -> None:
        retry = RETRY_FIRST_S
        while True:
            if await self._fetch():
                retry = RETRY_FIRST_S
                await asyncio.sleep(REFRESH_S)
            else:
                await asyncio.sleep(retry)
                retry = min(retry * 2, RETRY_MAX_S)

    # -- fetching --------------------------------------------------------------------------------

    async def _fetch(self) -> bool:
        """One fetch of the set, shared by whoever asks while it is under way; False if it failed."""
        # Shielded: a request that goes away does not cancel the fetch the others wait for.
        return await asyncio.shield(self._start_fetch())

    def _start_fetch(self) -> asyncio.Task[bool]:
        """The fetch under way, or a new one."""
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.create_task(self._fetch_once(), name="signing-keys-fetch")
        return self._inflight

    async def _fetch_once(self) -> bool:
        try:
            async with asyncio.timeout(2 * FETCH_TIMEOUT_S):
                url = self._jwks_url or await self._discover()
                keys = usable_keys(await self._get_json(url))
        except Exception as exc:  # whatever it was (a bad URL in the discovery document too): not loaded
            self._last_fetch_ok = False
            self._count("failed")
            log.warning(
                "could not fetch the identity provider's signing keys",
                extra={"error": str(exc) or type(exc).__name__, "cached_keys": len(self._keys)},
            )
            return False
        if keys.keys() != self._keys.keys() or not self._last_fetch_ok:
            log.info("signing keys loaded", extra={"kids": ",".join(sorted(keys)), "source": url})
        self._keys = keys
        self._last_fetch_ok = True
        self._count("ok")
        return True

    async def _discover(self) -> str:
        assert self._oidc_issuer is not None
        url = self._oidc_issuer.rstrip("/") + "/.well-known/openid-configuration"
        document = await self._get_json(url)
        if not isinstance(document, dict) or not isinstance(document.get("jwks_uri"), str):
            raise _FetchError(f"{url} names no jwks_uri")
        issuer = document.get("issuer")
        # OpenID Connect Discovery 4.3: the document's issuer is the one the tokens carry. A
        # trailing "/" is all AUTH_OIDC_ISSUER may leave out (Auth0's issuers end with one).
        if not isinstance(issuer, str) or issuer.rstrip("/") != self._oidc_issuer.rstrip("/"):
            raise _FetchError(
                f"{url} names the issuer {issuer!r}, not AUTH_OIDC_ISSUER {self._oidc_issuer!r}"
            )
        jwks_url: str = document["jwks_uri"]
        if not fetchable_url(jwks_url):
            raise _FetchError(f"{url} names a jwks_uri that is not https: {jwks_url[:200]}")
        self._discovered_issuer, self._jwks_url = issuer, jwks_url
        return jwks_url

    async def _get_json(self, url: str) -> Any:
        async with self._http.stream("GET", url) as response:
            if response.status_code != 200:
                redirect = " (redirects are not followed)" if response.is_redirect else ""
                raise _FetchError(f"{url} answered {response.status_code}{redirect}")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_DOCUMENT_BYTES:
                    raise _FetchError(f"{url} sent more than {MAX_DOCUMENT_BYTES} bytes")
        try:
            return json.loads(body)
        except ValueError as exc:
            raise _FetchError(f"{url} sent no JSON") from exc

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.auth_key_fetches.labels(outcome).inc()

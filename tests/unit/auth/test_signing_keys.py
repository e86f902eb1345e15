"""``SigningKeys`` against a JWK set served through httpx's mock transport, on a clock the test moves:
refetches on unknown kids at most once per interval, one fetch for many waiters, cached keys kept
while the provider fails, discovery, and which keys of a set are taken. Against a real provider on
127.0.0.1 that takes requests and never answers: a request waits for it a moment only. Keys come
over https (or loopback http) only, without redirects."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from app.auth import keys as keys_module
from app.auth.keys import KeysNotLoadedError, SigningKeys, UnknownKeyError, usable_keys
from tests.support.identity_provider import IdentityProvider, new_key

JWKS_URL = "https://idp.test/jwks"
ISSUER = "https://idp.test/"


class Provider:
    """The JWK set and discovery document, with a count of fetches and a switch to fail them."""

    def __init__(self) -> None:
        self.keys = [new_key("RS256", "k1")]
        self.fetches = 0
        self.attempts = 0
        self.down = False
        self.release: asyncio.Event | None = None
        self.issuer = ISSUER
        self.jwks_uri = JWKS_URL

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.attempts += 1
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/.well-known/openid-configuration":
            return httpx.Response(200, json={"issuer": self.issuer, "jwks_uri": self.jwks_uri})
        self.fetches += 1
        if self.release is not None:
            await self.release.wait()
        return httpx.Response(200, json={"keys": [k.jwk() for k in self.keys]})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def provider() -> Provider:
    return Provider()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def make_keys(provider: Provider, clock: Clock) -> AsyncIterator[Callable[..., SigningKeys]]:
    made: list[SigningKeys] = []

    def make(**kw: Any) -> SigningKeys:
        kw.setdefault("jwks_url", JWKS_URL)
        keys = SigningKeys(refetch_s=30.0, clock=clock, transport=httpx.MockTransport(provider.handle), **kw)
        made.append(keys)
        return keys

    yield make
    for keys in made:
        await keys.aclose()


async def until(condition: Callable[[], object], within: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not condition():
        assert loop.time() < deadline, "the condition did not come true in time"
        await asyncio.sleep(0.005)


async def loaded(make_keys: Callable[..., SigningKeys], **kw: Any) -> SigningKeys:
    keys = make_keys(**kw)
    assert await keys._fetch()
    return keys


async def test_an_unknown_kid_refetches_once_per_interval_however_many_come(
    make_keys: Callable[..., SigningKeys], provider: Provider, clock: Clock
) -> None:
    keys = await loaded(make_keys)
    assert provider.fetches == 1

    with pytest.raises(UnknownKeyError):
        await keys.key("forged-1")
    assert provider.fetches == 2
    for i in range(50):
        clock.now += 0.5  # 25 s in all: still within the 30 s
        with pytest.raises(UnknownKeyError):
            await keys.key(f"forged-{i + 2}")
    assert provider.fetches == 2
    assert (await keys.key("k1")).key_id == "k1"  # known keys never wait for anything

    clock.now += 5.0  # 30 s after the last refetch
    with pytest.raises(UnknownKeyError):
        await keys.key("forged-again")
    assert provider.fetches == 3


async def test_a_rotated_key_is_found_by_one_fetch_that_its_first_tokens_share(
    make_keys: Callable[..., SigningKeys], provider: Provider
) -> None:
    keys = await loaded(make_keys)
    provider.keys = [new_key("ES256", "k2")]
    provider.release = asyncio.Event()

    waiting = [asyncio.create_task(keys.key("k2")) for _ in range(20)]
    await until(lambda: provider.fetches == 2)  # the refetch is held at the provider meanwhile
    provider.release.set()
    found = await asyncio.gather(*waiting)

    assert {k.key_id for k in found} == {"k2"}
    assert provider.fetches == 2
    # The new set replaces the old: a key the provider withdrew is refused from then on.
    with pytest.raises(UnknownKeyError):
        await keys.key("k1")


async def test_concurrent_forged_kids_make_one_fetch(
    make_keys: Callable[..., SigningKeys], provider: Provider
) -> None:
    keys = await loaded(make_keys)
    provider.release = asyncio.Event()
    waiting = [asyncio.create_task(keys.key(f"forged-{i}")) for i in range(20)]
    await until(lambda: provider.fetches == 2)
    provider.release.set()
    outcomes = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(o, UnknownKeyError) for o in outcomes)
    assert provider.fetches == 2


async def test_cached_keys_keep_working_while_the_provider_is_down(
    make_keys: Callable[..., SigningKeys], provider: Provider, clock: Clock
) -> None:
    keys = await loaded(make_keys)
    assert keys.state == "ok"
    provider.down = True

    with pytest.raises(UnknownKeyError):
        await keys.key("new")  # the refetch fails
    assert (await keys.key("k1")).key_id == "k1"
    assert keys.state == "stale"

    provider.down = False
    provider.keys = [*provider.keys, new_key("EdDSA", "new")]
    clock.now += 30
    assert (await keys.key("new")).key_id == "new"
    assert keys.state == "ok"


async def test_before_any_key_loads_a_kid_is_neither_known_nor_unknown(
    make_keys: Callable[..., SigningKeys], provider: Provider
) -> None:
    provider.down = True
    keys = make_keys()
    with pytest.raises(KeysNotLoadedError):
        await keys.key("k1")  # refetched, in vain
    with pytest.raises(KeysNotLoadedError):
        await keys.key("k1")  # not refetched
    assert keys.state == "not_loaded"


async def test_the_background_task_loads_the_keys_once_the_provider_answers(
    make_keys: Callable[..., SigningKeys], provider: Provider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("app.auth.keys.RETRY_FIRST_S", 0.01)
    provider.down = True
    keys = make_keys()
    keys.start()
    await until(lambda: provider.attempts >= 2)  # tried, and tried again
    assert keys.state == "not_loaded"
    provider.down = False
    await until(lambda: keys.state == "ok")
    assert (await keys.key("k1")).key_id == "k1"


async def test_discovery_names_the_keys_and_the_issuer(
    make_keys: Callable[..., SigningKeys], provider: Provider
) -> None:
    keys = await loaded(make_keys, jwks_url=None, oidc_issuer=ISSUER.rstrip("/"))
    assert keys.issuer == ISSUER  # the document's, with its trailing "/"
    assert (await keys.key("k1")).key_id == "k1"


async def test_a_discovery_document_of_another_issuer_loads_nothing(
    make_keys: Callable[..., SigningKeys], provider: Provider
) -> None:
    provider.issuer = "https://evil.test/"
    keys = make_keys(jwks_url=None, oidc_issuer=ISSUER)
    assert not await keys._fetch()
    assert keys.state == "not_loaded"
    assert provider.fetches == 0


async def test_a_discovery_document_naming_no_url_loads_nothing(
    make_keys: Callable[..., SigningKeys], provider: Provider
) -> None:
    provider.jwks_uri = "http://[::1"  # httpx.InvalidURL, which is no httpx.HTTPError
    keys = make_keys(jwks_url=None, oidc_issuer=ISSUER)
    assert not await keys._fetch()
    assert keys.state == "not_loaded"


def test_only_public_signing_keys_of_the_pinned_algorithms_with_a_kid_are_taken() -> None:
    good = [new_key("RS256", "rsa"), new_key("ES256", "ec"), new_key("EdDSA", "ed")]
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024).public_key()
    weak = {**RSAAlgorithm.to_jwk(small, as_dict=True), "kid": "weak"}
    private = {**RSAAlgorithm.to_jwk(good[0].private, as_dict=True), "kid": "private"}
    document = {
        "keys": [
            *(k.jwk() for k in good),
            {"kty": "oct", "k": "c2VjcmV0", "kid": "hmac", "alg": "HS256"},
            {**new_key("RS256").jwk(), "kid": "enc", "use": "enc"},
            {**new_key("RS256").jwk(), "kid": "ps", "alg": "PS256"},
            {k: v for k, v in new_key("RS256").jwk().items() if k != "kid"},
            weak,
            private,
            "not a key",
        ]
    }
    assert sorted(usable_keys(document)) == ["ec", "ed", "rsa"]
    with pytest.raises(Exception, match="no usable signing key"):
        usable_keys({"keys": [{"kty": "oct", "k": "c2VjcmV0", "kid": "hmac"}]})


def test_a_key_pyjwk_fails_on_otherwise_is_skipped_not_the_whole_set(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # PyJWK raises NotImplementedError (no PyJWTError) for "alg": "none".
    unloadable = {**new_key("RS256").jwk(), "kid": "kid-of-none", "alg": "none"}
    with caplog.at_level(logging.INFO, logger="app.auth"):
        assert sorted(usable_keys({"keys": [unloadable, new_key("ES256", "ec").jwk()]})) == ["ec"]
    skipped = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert [getattr(r, "kid", None) for r in skipped] == ["kid-of-none"]


async def test_keys_sharing_a_kid_are_told_apart_by_algorithm_and_a_duplicate_is_not_taken(
    make_keys: Callable[..., SigningKeys], provider: Provider, caplog: pytest.LogCaptureFixture
) -> None:
    rsa_key, ec_key = new_key("RS256", "shared"), new_key("ES256", "shared")
    duplicate = new_key("RS256", "shared")  # the same kid and algorithm again: the first stays
    provider.keys = [rsa_key, ec_key, duplicate]
    with caplog.at_level(logging.WARNING, logger="app.auth"):
        keys = await loaded(make_keys)
    assert any("same kid and algorithm" in r.getMessage() for r in caplog.records)

    def public(key: Any) -> Any:
        return key.private.public_key().public_numbers()

    assert (await keys.key("shared", "ES256")).key.public_numbers() == public(ec_key)
    assert (await keys.key("shared", "RS256")).key.public_numbers() == public(rsa_key)
    # A kid known for other algorithms only: one of its keys (the verifier refuses the algorithm).
    assert (await keys.key("shared", "EdDSA")).algorithm_name in ("RS256", "ES256")
    assert provider.fetches == 1


async def test_a_redirect_is_a_failed_fetch_not_followed(make_keys: Callable[..., SigningKeys]) -> None:
    asked: list[str] = []

    async def redirecting(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        if request.url.path == "/jwks":
            return httpx.Response(302, headers={"Location": "http://idp.test/plain-jwks"})
        return httpx.Response(200, json={"keys": [new_key("RS256", "k1").jwk()]})

    keys = SigningKeys(jwks_url=JWKS_URL, transport=httpx.MockTransport(redirecting))
    try:
        assert not await keys._fetch()
        assert keys.state == "not_loaded"
        assert asked == [JWKS_URL]
    finally:
        await keys.aclose()


@pytest.mark.parametrize(
    "jwks_uri", ["http://idp.test/jwks", "ftp://idp.test/jwks", "http://127.0.0.1.idp.test/"]
)
async def test_a_discovery_document_naming_plain_http_keys_loads_nothing(
    make_keys: Callable[..., SigningKeys], provider: Provider, jwks_uri: str
) -> None:
    provider.jwks_uri = jwks_uri
    keys = make_keys(jwks_url=None, oidc_issuer=ISSUER)
    assert not await keys._fetch()
    assert keys.state == "not_loaded"
    assert provider.fetches == 0  # the http URL was never asked


@pytest.mark.parametrize(
    "jwks_uri", ["http://127.0.0.1:8080/jwks", "http://localhost/jwks", "http://[::1]/jwks"]
)
async def test_a_discovery_document_may_name_loopback_http_keys(
    make_keys: Callable[..., SigningKeys], provider: Provider, jwks_uri: str
) -> None:
    provider.jwks_uri = jwks_uri
    keys = await loaded(make_keys, jwks_url=None, oidc_issuer=ISSUER)
    assert (await keys.key("k1")).key_id == "k1"


@pytest.mark.parametrize(
    "configured",
    [{"jwks_url": "http://idp.test/jwks"}, {"jwks_url": None, "oidc_issuer": "http://idp.test/"}],
)
def test_plain_http_keys_off_loopback_are_refused_when_made(configured: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="https only"):
        SigningKeys(**configured)


# ---- a provider that takes requests and never answers (a real socket on 127.0.0.1) --------------

WAIT_S = 0.2
"""``REQUEST_WAIT_S`` in these tests; the fetch itself would wait ``FETCH_TIMEOUT_S`` (10 s)."""
WITHIN_S = 5.0
"""What the tests allow a request: half the fetch's own timeout, so a request that waited for the
fetch fails them."""


@pytest.fixture
def hanging_idp(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(keys_module, "REQUEST_WAIT_S", WAIT_S, raising=False)
    assert keys_module.FETCH_TIMEOUT_S >= 2 * WITHIN_S
    with IdentityProvider() as idp:
        yield idp


async def test_before_keys_load_a_request_waits_a_moment_for_a_provider_that_never_answers(
    hanging_idp: IdentityProvider,
) -> None:
    hanging_idp.hang()
    keys = SigningKeys(jwks_url=hanging_idp.jwks_url)
    try:
        keys.start()
        await until(lambda: hanging_idp.held == 1)  # the first fetch is under way, unanswered
        async with asyncio.timeout(WITHIN_S):
            with pytest.raises(KeysNotLoadedError):
                await keys.key(hanging_idp.key.kid)
            with pytest.raises(KeysNotLoadedError):
                await keys.key(hanging_idp.key.kid)  # a second one alike
        assert hanging_idp.held == 1  # both joined the fetch under way; it goes on
        assert keys.state == "not_loaded"
    finally:
        await keys.aclose()


async def test_an_unknown_kid_waits_a_moment_for_a_refetch_that_is_never_answered(
    hanging_idp: IdentityProvider,
) -> None:
    keys = SigningKeys(jwks_url=hanging_idp.jwks_url)
    try:
        assert await keys._fetch()
        hanging_idp.hang()
        async with asyncio.timeout(WITHIN_S):
            with pytest.raises(UnknownKeyError):
                await keys.key("rotated-1")  # starts the refetch, which never ends
            await until(lambda: hanging_idp.held == 1)
            with pytest.raises(UnknownKeyError):
                await keys.key("rotated-2")  # no refetch of its own: waits for that one
            assert (await keys.key(hanging_idp.key.kid)).key_id == hanging_idp.key.kid
        assert hanging_idp.held == 1
        assert keys.state == "ok"  # the refetch has not failed (yet): nothing changed
    finally:
        await keys.aclose()

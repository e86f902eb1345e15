"""Which webhook URLs the service posts to (FACES.md N-06, N-07), checked when a URL is given and
again before each delivery.

http and https only, no credentials in the URL. With ``WEBHOOK_ALLOWED_HOSTS`` set, the host must be
one of them (compared before anything is resolved, so no other name is even looked up). The host is
resolved, and every address it has must be a public unicast one unless ``WEBHOOK_ALLOW_PRIVATE``:
never loopback, private, shared, link-local, site-local, reserved; multicast and unspecified
addresses never at all. An IPv6 address that carries an IPv4 one (IPv4-mapped, 6to4, Teredo) is
judged by the IPv4 address too. Host names are looked up in a few threads of their own
(``system_resolver``), so that a slow DNS holds none of the threads the rest of the process shares.
A delivery then connects to the very address that was checked (``Target``), so a name that
resolves elsewhere a moment later (DNS rebinding) cannot send it anywhere else; redirects are not
followed.

The words of a refusal hold no part of the URL beyond its host: a query may carry a token.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from app.settings import Settings

MAX_URL_CHARS = 2048
RESOLVE_TIMEOUT_S = 5.0
LOOKUP_THREADS = 8
"""Host name lookups under way at once in a process; more wait their turn (within their 5 s)."""

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``resolve(host, port)``: the addresses of a host name, as text."""

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class WebhookRefusedError(ValueError):
    """The URL is not one the service posts to; the message says why (and holds no secret).
    ``transient``: its host did not resolve, which may change (a delivery is retried then)."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


@dataclass(frozen=True, slots=True)
class Target:
    """A checked URL: where a delivery connects (``request_url``, the checked address in place of
    the host name), and what it tells the receiver (``Host``, and the TLS server name)."""

    host: str
    request_url: httpx.URL
    host_header: str

    @property
    def sni_hostname(self) -> str | None:
        """The name TLS checks the receiver's certificate for (None: plain http)."""
        return self.host if self.request_url.scheme == "https" else None


_lookups: ThreadPoolExecutor | None = None
_lookups_made = threading.Lock()


def _lookup_threads() -> ThreadPoolExecutor:
    """The threads host names are looked up in: a lookup that outlasts its timeout still holds its
    thread until the system resolver gives up, and in the loop's default executor a slow DNS would
    hold every thread the rest of the process shares (``asyncio.to_thread``, the loop's own)."""
    global _lookups
    with _lookups_made:
        if _lookups is None:
            _lookups = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="webhook-dns")
        return _lookups


def _getaddrinfo(host: str, port: int) -> list[str]:
    return [str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


async def system_resolver(host: str, port: int) -> list[str]:
    """The system's addresses of ``host``, at most ``LOOKUP_THREADS`` lookups at once (one given
    up before its turn never starts)."""
    return await asyncio.get_running_loop().run_in_executor(_lookup_threads(), _getaddrinfo, host, port)


def _address(text: str) -> IpAddress | None:
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])  # an IPv6 zone is no part of it
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


def _carried(address: IpAddress) -> list[tuple[str, ipaddress.IPv4Address]]:
    """The IPv4 addresses an IPv6 one carries, with the kind of address that carries them: a 6to4
    address (2002::/16) is routed to its IPv4 one by a relay, a Teredo one (2001::/32) to its
    client's (and through its server)."""
    if not isinstance(address, ipaddress.IPv6Address):
        return []
    if address.sixtofour is not None:
        return [("6to4", address.sixtofour)]
    if address.teredo is not None:
        server, client = address.teredo
        return [("Teredo", client), ("Teredo", server)]
    return []


def refusal(address: IpAddress, *, allow_private: bool) -> str | None:
    """Why a delivery may not go to ``address``, or None if it may."""
    for kind, carried in _carried(address):
        why = refusal(carried, allow_private=allow_private)
        if why is not None:
            return f"{why} (in a {kind} address)"
    if address.is_unspecified:
        return "an unspecified address"
    if address.is_multicast:
        return "a multicast address"
    if allow_private:
        return None
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address"
    if isinstance(address, ipaddress.IPv6Address) and address.is_site_local:
        return "a site-local address"  # fec0::/10, deprecated; Python counts it global
    if address.is_private or address.is_reserved or not address.is_global:
        return "a private address"
    return None


class UrlPolicy:
    """The checks, as the settings say (``from_settings``); ``resolve`` is the system resolver
    unless a test gives another."""

    def __init__(
        self,
        *,
        allow_private: bool = False,
        allowed_hosts: Sequence[str] = (),
        resolve: Resolver = system_resolver,
    ) -> None:
        self.allow_private = allow_private
        self.allowed_hosts = frozenset(_host_key(h) for h in allowed_hosts if h)
        self._resolve = resolve

    @classmethod
    def from_settings(cls, settings: Settings, resolve: Resolver = system_resolver) -> UrlPolicy:
        return cls(
            allow_private=settings.webhook_allow_private,
            allowed_hosts=settings.webhook_hosts(),
            resolve=resolve,
        )

    def check_form(self, url: str) -> httpx.URL:
        """The checks that need no resolving: scheme, credentials, host, ``WEBHOOK_ALLOWED_HOSTS``."""
        if len(url) > MAX_URL_CHARS:
            raise WebhookRefusedError(f"the URL is longer than {MAX_URL_CHARS} characters")
        try:
            parsed = httpx.URL(url)
            host = parsed.raw_host.decode("ascii")
            port = parsed.port
        except (httpx.InvalidURL, ValueError, UnicodeError):
            raise WebhookRefusedError("not a valid URL") from None
        if port is not None and not 0 < port < 65536:
            raise WebhookRefusedError("not a valid URL: its port is out of range")
        if parsed.scheme not in ("http", "https"):
            raise WebhookRefusedError("only http and https URLs are taken")
        if parsed.userinfo:
            raise WebhookRefusedError("credentials in the URL are not taken")
        if not host:
            raise WebhookRefusedError("the URL names no host")
        if self.allowed_hosts and _host_key(host) not in self.allowed_hosts:
            raise WebhookRefusedError(f"host {host} is not one of WEBHOOK_ALLOWED_HOSTS")
        return parsed

    async def check(self, url: str) -> Target:
        """Where a delivery to ``url`` connects; raises ``WebhookRefusedError`` if it may not."""
        parsed = self.check_form(url)
        host = parsed.raw_host.decode("ascii")
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        literal = _address(host)
        if literal is not None:
            addresses = [str(literal)]
        else:
            try:
                async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                    addresses = await self._resolve(host.rstrip("."), port)
            except TimeoutError:
                late = f"host {host} did not resolve within {RESOLVE_TIMEOUT_S:g} s"
                raise WebhookRefusedError(late, transient=True) from None
            except (OSError, UnicodeError):
                raise WebhookRefusedError(f"host {host} does not resolve", transient=True) from None
            if not addresses:
                raise WebhookRefusedError(f"host {host} does not resolve", transient=True)
        checked: list[IpAddress] = []
        for text in addresses:
            address = _address(text)
            if address is None:
                raise WebhookRefusedError(f"host {host} resolves to no IP address")
            why = refusal(address, allow_private=self.allow_private)
            if why is not None:
                lifted = refusal(address, allow_private=True) is None
                raise WebhookRefusedError(
                    f"host {host} is {why}" + (" (WEBHOOK_ALLOW_PRIVATE is off)" if lifted else "")
                )
            checked.append(address)
        address = checked[0]
        return Target(
            host=host,
            request_url=parsed.copy_with(host=str(address), fragment=None),
            host_header=parsed.netloc.decode("ascii"),
        )


def _host_key(host: str) -> str:
    """A host as ``WEBHOOK_ALLOWED_HOSTS`` compares it: lower case, no trailing dot, an address in
    its one written form (``::1`` for ``0:0::1``)."""
    host = host.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host

"""Which webhook URLs the service posts to (FACES.md N-06), with a resolver the test plays: nothing
is looked up or sent anywhere (the system resolver's test plays the system's lookup)."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest

from app.settings import Settings
from app.webhooks.urls import LOOKUP_THREADS, UrlPolicy, WebhookRefusedError, system_resolver
from tests.support.server import async_wait_until


def resolver(answers: dict[str, list[str]]) -> tuple[list[str], object]:
    asked: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        asked.append(host)
        if host not in answers:
            raise OSError("no such host")
        return answers[host]

    return asked, resolve


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1", "loopback"),
        ("127.3.4.5", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.9", "private"),
        ("192.168.1.1", "private"),
        ("100.64.0.1", "private"),  # shared address space (carrier NAT)
        ("fd00::1", "private"),
        ("169.254.169.254", "link-local"),  # the cloud metadata service
        ("fe80::1", "link-local"),
        ("::ffff:10.0.0.1", "private"),  # an IPv4-mapped address is judged as the IPv4 one
        ("::ffff:127.0.0.1", "loopback"),
        ("240.0.0.1", "private"),  # reserved
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("fec0::1", "site-local"),  # deprecated site-local IPv6 (Python counts it global)
        ("2002:7f00:1::1", r"loopback address \(in a 6to4"),  # 6to4 of 127.0.0.1
        ("2002:a9fe:a9fe::", r"link-local address \(in a 6to4"),  # 6to4 of 169.254.169.254
        ("2002:0a00:0001::", r"private address \(in a 6to4"),  # 6to4 of 10.0.0.1
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", r"loopback address \(in a Teredo"),  # client 127.0.0.1
    ],
)
async def test_a_host_that_resolves_to_a_non_public_address_is_refused(address: str, why: str) -> None:
    _, resolve = resolver({"hooks.example.com": ["93.184.216.34", address]})
    policy = UrlPolicy(resolve=resolve)  # type: ignore[arg-type]

    with pytest.raises(WebhookRefusedError, match=why):
        await policy.check("https://hooks.example.com/in")


async def test_a_6to4_address_of_a_public_ipv4_one_is_taken_and_a_teredo_one_is_private_anyway() -> None:
    six, teredo = "2002:5db8:d822::1", "2001:0:4136:e378:8000:63bf:a247:27dd"  # both carry 93.184.216.34
    _, resolve = resolver({"six.example.com": [six], "teredo.example.com": [teredo]})
    policy = UrlPolicy(resolve=resolve)  # type: ignore[arg-type]

    assert (await policy.check("https://six.example.com/in")).request_url.host == six
    with pytest.raises(WebhookRefusedError, match=r"a private address \(WEBHOOK_ALLOW_PRIVATE is off\)$"):
        await policy.check("https://teredo.example.com/in")  # 2001::/32 is not a global range
    allowed = UrlPolicy(allow_private=True, resolve=resolve)  # type: ignore[arg-type]
    assert (await allowed.check("https://teredo.example.com/in")).request_url.host == teredo


@pytest.mark.parametrize(
    ("address", "refused"),
    [
        ("127.0.0.1", False),
        ("10.0.0.1", False),
        ("169.254.1.1", False),
        ("0.0.0.0", True),
        ("224.0.0.9", True),
    ],
)
async def test_allow_private_takes_private_addresses_but_never_multicast_or_unspecified_ones(
    address: str, refused: bool
) -> None:
    _, resolve = resolver({"box.internal": [address]})
    policy = UrlPolicy(allow_private=True, resolve=resolve)  # type: ignore[arg-type]

    if refused:
        with pytest.raises(WebhookRefusedError):
            await policy.check("http://box.internal/hook")
    else:
        assert (await policy.check("http://box.internal/hook")).request_url.host == address


async def test_a_delivery_connects_to_the_address_checked_and_tells_the_receiver_its_name() -> None:
    _, resolve = resolver({"hooks.example.com": ["93.184.216.34"]})
    policy = UrlPolicy(resolve=resolve)  # type: ignore[arg-type]

    target = await policy.check("https://Hooks.Example.com:8443/in?token=s3cret#frag")

    assert str(target.request_url) == "https://93.184.216.34:8443/in?token=s3cret"
    assert target.host_header == "hooks.example.com:8443"
    assert target.sni_hostname == "hooks.example.com"
    plain = await policy.check("http://hooks.example.com/in")
    assert (str(plain.request_url), plain.host_header, plain.sni_hostname) == (
        "http://93.184.216.34/in",
        "hooks.example.com",
        None,
    )


async def test_allowed_hosts_are_compared_before_anything_is_resolved() -> None:
    asked, resolve = resolver({"localhost": ["127.0.0.1"], "hooks.example.com": ["93.184.216.34"]})
    policy = UrlPolicy(allow_private=True, allowed_hosts=["127.0.0.1", "HOOKS.example.com."], resolve=resolve)  # type: ignore[arg-type]

    assert (await policy.check("http://127.0.0.1:9000/x")).request_url.host == "127.0.0.1"
    assert (await policy.check("https://hooks.example.com/x")).request_url.host == "93.184.216.34"
    for url in ("http://localhost:9000/x", "https://example.org/x", "http://127.0.0.2/", "http://[::1]/"):
        with pytest.raises(WebhookRefusedError, match="WEBHOOK_ALLOWED_HOSTS"):
            await policy.check(url)
    assert asked == ["hooks.example.com"]


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://hooks.example.com/x", "http and https"),
        ("file:///etc/passwd", "http and https"),
        ("javascript:alert(1)", "http and https"),
        ("https://user:secret@hooks.example.com/x", "credentials"),
        ("https:///x", "no host"),
        ("http://hooks.example.com:99999/x", "not a valid URL"),
        ("https://nowhere.invalid/x", "does not resolve"),
        ("https://hooks.example.com/" + "a" * 2100, "longer than"),
    ],
)
async def test_what_is_not_an_http_url_of_a_known_host_is_refused_in_words_that_hold_no_secret(
    url: str, why: str
) -> None:
    _, resolve = resolver({"hooks.example.com": ["93.184.216.34"]})
    policy = UrlPolicy(resolve=resolve)  # type: ignore[arg-type]

    with pytest.raises(WebhookRefusedError, match=why) as refused:
        await policy.check(url)
    assert "secret" not in str(refused.value) and "/x" not in str(refused.value)


async def test_a_host_that_resolves_elsewhere_at_delivery_is_refused_then() -> None:
    answers = {"rebind.example.com": ["93.184.216.34"]}
    _, resolve = resolver(answers)
    policy = UrlPolicy(resolve=resolve)  # type: ignore[arg-type]
    await policy.check("https://rebind.example.com/x")

    answers["rebind.example.com"] = ["127.0.0.1"]

    with pytest.raises(WebhookRefusedError, match="loopback"):
        await policy.check("https://rebind.example.com/x")


def test_the_policy_follows_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEBHOOK_ALLOWED_HOSTS", raising=False)
    default = UrlPolicy.from_settings(Settings(_env_file=None))  # type: ignore[call-arg]
    assert (default.allow_private, default.allowed_hosts) == (False, frozenset())

    set_ = UrlPolicy.from_settings(
        Settings(_env_file=None, webhook_allow_private=True, webhook_allowed_hosts=" A.example , ::1 ,")  # type: ignore[call-arg]
    )
    assert (set_.allow_private, set_.allowed_hosts) == (True, frozenset({"a.example", "::1"}))


async def test_host_lookups_take_a_few_threads_of_their_own_and_leave_the_shared_ones_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A DNS server that never answers: each lookup holds its thread until the test lets it go.
    answer = threading.Event()
    counted = threading.Lock()
    under_way = most = 0

    def stuck(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        nonlocal under_way, most
        with counted:
            under_way += 1
            most = max(most, under_way)
        try:
            answer.wait(30)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port))]
        finally:
            with counted:
                under_way -= 1

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    # More than the loop's default executor has threads (32 at most).
    lookups = [asyncio.create_task(system_resolver(f"h{i}.example.com", 443)) for i in range(40)]
    try:
        await async_wait_until(lambda: under_way >= LOOKUP_THREADS, within=10, what="lookups under way")
        # The threads the rest of the process shares (asyncio.to_thread, the loop's own) are free.
        async with asyncio.timeout(10):
            assert await asyncio.to_thread(lambda: "free") == "free"
    finally:
        answer.set()
        found = await asyncio.gather(*lookups)

    assert most == LOOKUP_THREADS
    assert found == [["93.184.216.34"]] * 40

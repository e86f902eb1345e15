"""Which webhook URLs the service posts to (FACES.md N-06), with a resolver the test plays: nothing
is looked up or sent anywhere."""

from __future__ import annotations

import pytest

from app.settings import Settings
from app.webhooks.urls import UrlPolicy, WebhookRefusedError


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
    ],
)
async def test_a_host_that_resolves_to_a_non_public_address_is_refused(address: str, why: str) -> None:
    _, resolve = resolver({"hooks.example.com": ["93.184.216.34", address]})
    policy = UrlPolicy(resolve=resolve)  # type: ignore[arg-type]

    with pytest.raises(WebhookRefusedError, match=why):
        await policy.check("https://hooks.example.com/in")


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
        assert (await policy.check("http://box.internal/hook")).address == address


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

    assert (await policy.check("http://127.0.0.1:9000/x")).address == "127.0.0.1"
    assert (await policy.check("https://hooks.example.com/x")).address == "93.184.216.34"
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

"""The instances behind the router: which are up, which one serves the next request.

Each instance is a ``kvloom serve`` (or any OpenAI-compatible server with ``GET /health``)
of one role, ``prefill`` or ``decode``. An instance is up when its ``/health`` answered 200
at its last check, and goes down when a request to it cannot connect; instances that are
down are checked again every ``health_interval`` seconds (and at once when a role has no
instance up left), so that one that comes back serves again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")

#: Seconds a ``/health`` check may take before the instance counts as down.
HEALTH_CHECK_TIMEOUT_S = 5.0


@dataclass
class Instance:
    url: str
    """Where it serves, without a trailing slash (``http://10.0.0.5:8100``)."""
    role: str
    up: bool = False
    reason: str = "not checked yet"
    """Why it is down (the last check's or request's failure)."""

    def describe(self) -> str:
        return f"{self.url} ({self.reason})"


@dataclass
class InstanceGroup:
    """The instances of one role, taken in turn (round robin) among those up."""

    role: str
    instances: list[Instance]
    _next: int = field(default=0, repr=False)

    def in_turn(self) -> list[Instance]:
        """The instances that are up, the next in turn first (and the turn moves on)."""
        count = len(self.instances)
        order = [self.instances[(self._next + i) % count] for i in range(count)]
        self._next = (self._next + 1) % count
        return [instance for instance in order if instance.up]

    def down(self) -> list[Instance]:
        return [instance for instance in self.instances if not instance.up]


def normalize_url(url: str) -> str:
    """``url`` as the router joins paths to it: with a scheme (``http://`` when it has none),
    without a trailing slash; a ``ValueError`` for one that is not a URL."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ValueError(f"{url!r} is not a URL ({exc})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{url!r} is not an http(s) URL with a host (e.g. http://127.0.0.1:8100)")
    return url


class InstancePool:
    """The prefill and decode instances and their health, checked through ``client``."""

    def __init__(self, prefill: list[str], decode: list[str], client: httpx.AsyncClient) -> None:
        self.client = client
        self.groups: dict[str, InstanceGroup] = {}
        for role, urls in (("prefill", prefill), ("decode", decode)):
            if not urls:
                raise ValueError(f"--{role}: at least one {role} instance is needed")
            self.groups[role] = InstanceGroup(role, [Instance(normalize_url(url), role) for url in urls])
        self._checking: dict[str, asyncio.Lock] = {role: asyncio.Lock() for role in ROLES}

    def all(self) -> list[Instance]:
        return [instance for group in self.groups.values() for instance in group.instances]

    def healthy(self) -> bool:
        """At least one instance of each role is up."""
        return all(any(instance.up for instance in group.instances) for group in self.groups.values())

    async def check(self, instance: Instance) -> bool:
        """Ask ``instance``'s ``/health``; record (and log a change of) its state."""
        try:
            response = await self.client.get(instance.url + "/health", timeout=HEALTH_CHECK_TIMEOUT_S)
            reason = None if response.status_code == 200 else f"/health answered {response.status_code}"
        except httpx.HTTPError as exc:
            reason = describe_error(exc)
        if reason is None:
            self.mark_up(instance)
        else:
            self.mark_down(instance, reason)
        return instance.up

    async def check_all(self, instances: list[Instance] | None = None) -> None:
        """Check ``instances`` (default: all) concurrently."""
        await asyncio.gather(*(self.check(instance) for instance in (self.all() if instances is None else instances)))

    async def up_in_turn(self, role: str) -> list[Instance]:
        """The instances of ``role`` to try for a request, in turn; when none is up, those
        that are down are checked again first (one check at a time per role)."""
        group = self.groups[role]
        candidates = group.in_turn()
        if not candidates:
            async with self._checking[role]:
                if not any(instance.up for instance in group.instances):
                    await self.check_all(group.down())
            candidates = group.in_turn()
        return candidates

    def mark_up(self, instance: Instance) -> None:
        if not instance.up:
            logger.info("%s instance %s is up", instance.role, instance.url)
        instance.up, instance.reason = True, ""

    def mark_down(self, instance: Instance, reason: str) -> None:
        if instance.up or instance.reason != reason:
            logger.warning("%s instance %s is down: %s", instance.role, instance.url, reason)
        instance.up, instance.reason = False, reason

    def unavailable_message(self, role: str) -> str:
        """Why no instance of ``role`` can take a request, naming each."""
        instances = self.groups[role].instances
        return f"no {role} instance is reachable: " + "; ".join(instance.describe() for instance in instances)

    async def wait_until_up(self, timeout: float, interval: float = 0.5) -> None:
        """Check every instance until all are up, or ``timeout`` seconds have passed; then a
        ``ValueError`` if a role has no instance up (the ones still down are logged and
        checked again later)."""
        deadline = time.monotonic() + timeout
        while True:
            await self.check_all([instance for instance in self.all() if not instance.up])
            if all(instance.up for instance in self.all()) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(interval)
        for role, group in self.groups.items():
            if not any(instance.up for instance in group.instances):
                raise ValueError(f"{self.unavailable_message(role)} (waited {timeout:g} s, --startup-timeout)")

    async def recheck_down_forever(self, interval: float) -> None:
        """Every ``interval`` seconds, check the instances that are down."""
        while True:
            await asyncio.sleep(interval)
            down = [instance for instance in self.all() if not instance.up]
            if down:
                await self.check_all(down)


def describe_error(exc: httpx.HTTPError) -> str:
    """A transport error in a few words (httpx's messages are sometimes empty)."""
    text = str(exc).strip()
    kind = type(exc).__name__
    return f"{kind}: {text}" if text else kind


def is_connect_error(exc: httpx.HTTPError) -> bool:
    """The request never reached the instance: safe to send it to another one."""
    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))

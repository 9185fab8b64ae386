"""Getting alerts to their receivers: Alertmanager's own API and Alertmanager-style webhooks.

Two receivers, two contracts. Alertmanager (`POST /api/v2/alerts`) wants the state of every
firing alert, re-sent before the `endsAt` it was last given runs out (otherwise it resolves the
alert by itself), and a resolved alert once with `endsAt` in the past. A webhook receiver (a chat
bridge, a pager written for Alertmanager) wants what Alertmanager would post it: notifications of
transitions, firing then resolved. Either may be down: a delivery is tried a few times with
backoff, and what did not get through stays queued (bounded) for the next cycle.

Fingerprints are Alertmanager's own (64-bit FNV-1a over the sorted label names and values, each
followed by the 0xff separator, printed as 16 hex digits), so the one kvtrace prints is the one
Alertmanager shows for the same alert.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import StrEnum
from typing import Any

import msgspec

log = logging.getLogger("kvtrace.alerts")

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK = 0xFFFF_FFFF_FFFF_FFFF
_SEPARATOR = 0xFF
ZERO_TIME = "0001-01-01T00:00:00Z"  # Go's zero time: what Alertmanager writes for "no end yet"


def fingerprint(labels: Mapping[str, str]) -> str:
    """Alertmanager's fingerprint of a label set, as 16 hex digits."""
    h = _FNV_OFFSET
    for name in sorted(labels):
        for part in (name, labels[name]):
            for byte in part.encode():
                h = ((h ^ byte) * _FNV_PRIME) & _MASK
            h = ((h ^ _SEPARATOR) * _FNV_PRIME) & _MASK
    return f"{h:016x}"


def rfc3339(wall_s: float) -> str:
    """Wall-clock seconds as RFC 3339 UTC with milliseconds, the form Alertmanager parses."""
    return datetime.fromtimestamp(wall_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class Notice(msgspec.Struct, frozen=True, kw_only=True):
    """One alert as receivers see it, frozen when it was queued: later changes to the alert
    (it resolves, its value moves) do not rewrite a notification still waiting to go out."""

    labels: dict[str, str]  # only non-empty values: Alertmanager drops empty ones
    annotations: dict[str, str]
    firing: bool
    starts_at_s: float  # wall clock
    ends_at_s: float = 0.0  # wall clock; 0 while firing
    generator_url: str = ""

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.labels)

    def alertmanager(self, valid_until_s: float) -> dict[str, Any]:
        """The postable alert of Alertmanager's v2 API. A firing alert ends at `valid_until_s`
        unless it is re-sent before then."""
        ends = max(valid_until_s if self.firing else self.ends_at_s, self.starts_at_s)  # it refuses ends < starts
        return {"labels": self.labels, "annotations": self.annotations, "startsAt": rfc3339(self.starts_at_s),
                "endsAt": rfc3339(ends),
                "generatorURL": self.generator_url}

    def webhook(self) -> dict[str, Any]:
        """One alert as Alertmanager writes it in a webhook notification."""
        return {"status": "firing" if self.firing else "resolved", "labels": self.labels,
                "annotations": self.annotations, "startsAt": rfc3339(self.starts_at_s),
                "endsAt": rfc3339(self.ends_at_s) if self.ends_at_s else ZERO_TIME,
                "generatorURL": self.generator_url, "fingerprint": self.fingerprint}


def webhook_payload(notices: Sequence[Notice], receiver: str = "kvtrace") -> dict[str, Any]:
    """Alertmanager's webhook JSON (version 4), so any receiver built for it accepts ours."""
    alerts = [n.webhook() for n in notices]
    common: dict[str, str] = {}
    if notices:
        common = {k: v for k, v in notices[0].labels.items() if all(n.labels.get(k) == v for n in notices)}
    return {"version": "4", "receiver": receiver,
            "status": "firing" if any(n.firing for n in notices) else "resolved",
            "alerts": alerts, "groupLabels": {}, "commonLabels": common, "commonAnnotations": {},
            "externalURL": "", "groupKey": "kvtrace", "truncatedAlerts": 0}


class ReceiverKind(StrEnum):
    ALERTMANAGER = "alertmanager"
    WEBHOOK = "webhook"


@dataclass(frozen=True, slots=True)
class Receiver:
    kind: ReceiverKind
    url: str

    @classmethod
    def alertmanager(cls, base: str) -> Receiver:
        """An Alertmanager by its base URL (`http://host:9093`, a path prefix allowed), or by the
        full alerts endpoint."""
        base = base.rstrip("/")
        return cls(ReceiverKind.ALERTMANAGER, base if base.endswith("/api/v2/alerts") else base + "/api/v2/alerts")

    def __str__(self) -> str:
        return f"{self.kind.value} {self.url}"


class DeliveryError(Exception):
    """A delivery that did not get through; `retryable` says whether sending again could help
    (connection refused, timeout, 5xx, 429) or not (the receiver refused the request)."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


def _cause(exc: BaseException) -> DeliveryError:
    if isinstance(exc, urllib.error.HTTPError):
        try:
            text = exc.read(300).decode(errors="replace")
        except OSError:
            text = ""
        text = " ".join(text.split())
        retryable = exc.code >= 500 or exc.code == 429
        return DeliveryError(f"HTTP {exc.code} {exc.reason}" + (f": {text}" if text else ""), retryable)
    if isinstance(exc, urllib.error.URLError):
        reason = exc.reason
        return DeliveryError(getattr(reason, "strerror", None) or str(reason))
    return DeliveryError(getattr(exc, "strerror", None) or str(exc) or type(exc).__name__)


def post_json(url: str, body: Any, timeout_s: float) -> None:
    """POST `body` as JSON; any failure as a DeliveryError naming the cause."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "kvtrace-alerts"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
    except (OSError, ValueError) as exc:  # URLError, HTTPError and timeouts are OSErrors
        raise _cause(exc) from None


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded attempts with doubling backoff: a receiver blinking (a restart, a full queue) is
    ridden out inside one cycle; one that stays down fails the cycle, and the next retries."""

    attempts: int = 3
    backoff_s: float = 0.5
    timeout_s: float = 10.0


def deliver(receiver: Receiver, body: Any, policy: RetryPolicy,
            sleep: Callable[[float], Any] = time.sleep) -> None:
    """Send one body, retrying what may succeed later. Raises DeliveryError with a one-line
    message naming the receiver, the attempts and the last cause."""
    delay = policy.backoff_s
    for attempt in range(1, policy.attempts + 1):
        try:
            post_json(receiver.url, body, policy.timeout_s)
            return
        except DeliveryError as exc:
            if not exc.retryable or attempt == policy.attempts:
                tries = f"{attempt} attempt{'s' if attempt > 1 else ''}"
                raise DeliveryError(f"alert delivery to {receiver} failed after {tries}: {exc}",
                                    exc.retryable) from None
        sleep(delay)
        delay *= 2


@dataclass(slots=True)
class Outbox:
    """What one receiver has not taken yet, oldest first. Bounded: a receiver down for days
    loses its oldest notifications (counted in `dropped`), not the process's memory."""

    receiver: Receiver
    limit: int = 1000
    queued: list[Notice] = field(default_factory=list)
    dropped: int = 0

    def add(self, notices: Iterable[Notice]) -> None:
        self.queued.extend(notices)
        excess = len(self.queued) - self.limit
        if excess > 0:
            del self.queued[:excess]
            self.dropped += excess
            log.warning("alert outbox for %s full: dropped the %d oldest notifications", self.receiver, excess)

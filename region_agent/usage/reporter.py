"""The reporter: spooled records → the control plane's usage endpoint, at least once, never lost.

One POST at a time, oldest records first. The outcome of a POST decides what happens to its
records, and only the spool's state changes as a result:

===========================================  ==================================================
answer                                       effect
===========================================  ==================================================
2xx (even if the body then fails to arrive)  records marked sent; backoff reset
network error, timeout, dropped connection   retried after backoff (the same keys)
5xx, 429, and ``retry_statuses`` (401, 403,  retried after backoff, or Retry-After when longer
404, 408, 425 by default)
413 Payload Too Large                        split in halves; a single record is quarantined
any other 4xx                                bisected until the rejected records are isolated
                                             (``bisect_rejected``), which are quarantined
===========================================  ==================================================

Because every record keeps its idempotency key and exact bytes across retries, "retry until a
2xx" is safe: a POST that reached the control plane but whose answer was lost is sent again and
deduplicated there. A record is marked sent only after a 2xx for a POST that contained it.

Nothing is sent that can not be marked: the reporter sends only while the spool is available
(``available``), and any failed spool call (above all ``mark_sent`` on a volume that turned
read-only) stops it at once and is handed to ``spool_lost``; the service then reopens the spool
and sets ``available`` again. A batch acknowledged but not marked is sent again later, and the
control plane deduplicates it by key.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

import aiohttp

from region_agent.base.clock import Backoff, Clock
from region_agent.usage.metrics import UsageMetrics
from region_agent.usage.records import batch_body
from region_agent.usage.settings import UsageSettings
from region_agent.usage.spool import Pending, Spool

logger = logging.getLogger("region_agent.usage.reporter")

Sleep = Callable[[float], Awaitable[None]]


class SpoolLostError(Exception):
    """A spool call of the reporter failed: stop sending until the spool is available again."""


T = TypeVar("T")
OutcomeKind = Literal["ack", "retry", "reject", "too_large"]


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: OutcomeKind
    status: int | None = None
    error: str = ""  # metric label for failures
    retry_after: float | None = None
    detail: str = ""


class TokenSource:
    """The bearer token: the secret file if configured (re-read when its mtime changes), else inline."""

    def __init__(self, settings: UsageSettings) -> None:
        self._file = settings.token_file or None  # "" from the environment means "no file"
        self._inline = settings.token.get_secret_value() if settings.token is not None else None
        self._mtime: float | None = None
        self._cached: str | None = None

    def get(self) -> str | None:
        if self._file is not None:
            try:
                mtime = os.stat(self._file).st_mtime
            except OSError:
                return self._inline
            if mtime != self._mtime:
                with open(self._file, encoding="utf-8") as fh:
                    self._cached = fh.read().strip() or None
                self._mtime = mtime
            return self._cached
        return self._inline

    def invalidate(self) -> None:
        self._mtime = None


def parse_retry_after(value: str | None, now_wall: float) -> float | None:
    """Retry-After as seconds from now: delta-seconds or an HTTP-date (RFC 9110 §10.2.3)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now_wall)


def classify(status: int, retry_after: float | None, retry_statuses: tuple[int, ...]) -> Outcome:
    """What an HTTP status means for the records of the batch (the table in the module docstring)."""
    if 200 <= status < 300:
        return Outcome("ack", status)
    if status == 429:
        return Outcome("retry", status, "status_429", retry_after)
    if status >= 500:
        return Outcome("retry", status, "status_5xx", retry_after)
    if status == 413:
        return Outcome("too_large", status, "rejected")
    if status in retry_statuses:
        return Outcome("retry", status, "status_retry", retry_after)
    if 400 <= status < 500:
        return Outcome("reject", status, "rejected")
    return Outcome("retry", status, "status_retry", retry_after)  # 1xx/3xx: a proxy misbehaving


class Reporter:
    """Sends the spool's unsent records in batches; run :meth:`run` as one long-lived task."""

    def __init__(
        self, settings: UsageSettings, spool: Spool, metrics: UsageMetrics, *, region: str, node: str,
        clock: Clock, sleep: Sleep = asyncio.sleep, available: asyncio.Event | None = None,
        spool_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.available = available  # None: the spool is always usable (tests of the reporter alone)
        self.spool_lost = spool_lost
        self.spool = spool
        self.metrics = metrics
        self.region = region
        self.node = node
        self.clock = clock
        self.sleep = sleep
        self.tokens = TokenSource(settings)
        self.backoff = Backoff(initial=settings.backoff_initial, cap=settings.backoff_cap,
                               reset_after=max(120.0, settings.backoff_cap * 4))
        self._wake = asyncio.Event()
        self._suspects: list[list[Pending]] = []  # halves of rejected batches still to resend
        self._suspects_generation = 0  # the spool opening their seqs belong to
        self._failures = 0
        self._failing_since: float | None = None
        self.posts = 0  # POSTs attempted (tests, bench)

    def notify(self, unsent: int) -> None:
        """Called after records were spooled: a full batch is sent at once instead of after the interval."""
        if unsent >= self.settings.batch_size:
            self._wake.set()

    def kick(self) -> None:
        """Send now (shutdown, tests)."""
        self._wake.set()

    async def run(self) -> None:
        if self.settings.endpoint_url is None:
            logger.warning("usage endpoint_url is not set: records are spooled and kept, never reported")
        async with self._http() as http:
            while True:
                if self.available is not None:
                    await self.available.wait()
                more = False
                try:
                    more = await self.report_once(http)
                    self.metrics.last_success.labels("report").set(self.clock.wall())
                except asyncio.CancelledError:
                    raise
                except SpoolLostError as exc:
                    # Bisection halves carry seqs of the spool that was lost: read afresh once it is back.
                    self._suspects.clear()
                    self.metrics.loop_errors.labels("report").inc()
                    logger.error("usage reporting stops: %s", exc)
                    if self.spool_lost is not None:
                        self.spool_lost(str(exc))
                    if self.available is None:
                        await self.sleep(self.backoff.next_delay(self.clock.monotonic()))
                    continue
                except Exception:
                    self.metrics.loop_errors.labels("report").inc()
                    logger.exception("usage reporter failed; retrying")
                    await self.sleep(self.backoff.next_delay(self.clock.monotonic()))
                    continue
                if not more:
                    await self._wait(self.settings.report_interval)

    def _http(self) -> aiohttp.ClientSession:
        ssl_ctx: ssl.SSLContext | bool = True
        if self.settings.ca_file:
            ssl_ctx = ssl.create_default_context(cafile=self.settings.ca_file)
        connector = aiohttp.TCPConnector(limit=1, ssl=ssl_ctx)
        return aiohttp.ClientSession(connector=connector, headers={"User-Agent": "region-agent-usage/1"})

    async def _wait(self, seconds: float) -> None:
        if self._wake.is_set():
            self._wake.clear()
            return
        waiter = asyncio.ensure_future(self._wake.wait())
        sleeper = asyncio.ensure_future(self.sleep(seconds))
        try:
            await asyncio.wait({waiter, sleeper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            sleeper.cancel()
        self._wake.clear()

    async def report_once(self, http: aiohttp.ClientSession) -> bool:
        """Send one batch; True when more is waiting (send again without the interval)."""
        if self.settings.endpoint_url is None:
            self.metrics.observe_spool(await self._spool("stats", self.spool.stats()), self.clock.wall())
            return False
        generation = self.spool.generation
        if self._suspects_generation != generation:
            self._suspects.clear()  # seqs of an earlier opening (the spool was lost and reopened meanwhile)
            self._suspects_generation = generation
        from_suspects = bool(self._suspects)
        if from_suspects:
            batch = self._suspects.pop()
        else:
            batch = await self._spool("next_batch", self.spool.next_batch(self.settings.batch_size))
        if not batch:
            self.metrics.observe_spool(await self._spool("stats", self.spool.stats()), self.clock.wall())
            return False
        outcome = await self._post(http, self.settings.endpoint_url, batch)
        if self.spool.generation != generation or not self.spool.is_open:
            raise SpoolLostError("the spool was closed or reopened while a batch was in flight (it is sent "
                                 "again later; the control plane deduplicates it)")
        now = self.clock.wall()
        seqs = [p.seq for p in batch]
        if outcome.kind == "ack":
            stats = await self._spool(f"marking {len(seqs)} acknowledged records sent", self.spool.mark_sent(seqs, now))
            self.metrics.records_reported.inc(len(batch))
            self.metrics.observe_spool(stats, now)
            self.backoff.reset()
            if self._failures:
                logger.info("usage endpoint accepts records again after %d failed attempts over %.0f s",
                            self._failures, now - (self._failing_since or now))
            self._failures, self._failing_since = 0, None
            return bool(self._suspects) or len(batch) >= self.settings.batch_size
        self.metrics.report_errors.labels(outcome.error).inc()
        if outcome.kind == "retry":
            if from_suspects:
                self._suspects.append(batch)
            await self._retry_later(outcome, len(batch))
            return True
        # A verdict on the records: isolate the rejected ones, then put them aside.
        if len(batch) > 1 and (outcome.kind == "too_large" or self.settings.bisect_rejected):
            half = len(batch) // 2
            self._suspects.extend([batch[half:], batch[:half]])  # the first half is popped first
            logger.warning("usage batch of %d records rejected with %s; resending in halves to isolate the "
                           "rejected records", len(batch), outcome.status)
            return True
        reason = "too-large" if outcome.kind == "too_large" else f"rejected-{outcome.status}"
        stats = await self._spool("quarantine", self.spool.quarantine(seqs, now, status=outcome.status, reason=reason))
        self.metrics.records_quarantined.labels(reason).inc(len(batch))
        self.metrics.observe_spool(stats, now)
        logger.error("usage: %d record(s) quarantined after HTTP %s (%s); first key %s. They stay in the "
                     "spool's quarantine table until requeued", len(batch), outcome.status, outcome.detail,
                     batch[0].key)
        return True

    async def _spool(self, doing: str, call: Awaitable[T]) -> T:
        """Await a spool call; its failure means the spool is lost for reporting (:class:`SpoolLostError`)."""
        try:
            return await call
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise SpoolLostError(f"spool {self.spool.path}: {doing} failed: {exc}") from exc

    async def _retry_later(self, outcome: Outcome, size: int) -> None:
        now = self.clock.monotonic()
        delay = self.backoff.next_delay(now)
        if outcome.retry_after is not None:
            delay = max(delay, min(outcome.retry_after, self.settings.retry_after_cap))
        self._failures += 1
        if self._failing_since is None:
            self._failing_since = self.clock.wall()
        # The first failure and then every tenth: an outage must be visible, not flood the log.
        if self._failures == 1 or self._failures % 10 == 0:
            logger.warning("usage report of %d records failed (%s %s, attempt %d); retrying in %.1f s",
                           size, outcome.error, outcome.status or outcome.detail, self._failures, delay)
        await self.sleep(delay)

    async def _post(self, http: aiohttp.ClientSession, url: str, batch: list[Pending]) -> Outcome:
        body = batch_body([p.body for p in batch], region=self.region, node=self.node,
                          sent_at=self.clock.wall())
        headers = {"Content-Type": "application/json",
                   "X-Usage-Batch": hashlib.sha256("\n".join(p.key for p in batch).encode()).hexdigest()[:32]}
        token = self.tokens.get()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        started = self.clock.monotonic()
        self.posts += 1
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.request_timeout)
            async with http.post(url, data=body, headers=headers, timeout=timeout) as resp:
                status = resp.status
                retry_after = parse_retry_after(resp.headers.get("Retry-After"), self.clock.wall())
                try:
                    detail = (await resp.content.read(512)).decode("utf-8", "replace")
                except (TimeoutError, aiohttp.ClientError, OSError):
                    detail = ""  # a 2xx status already means committed; the body is only for logs
        except TimeoutError:
            return Outcome("retry", None, "timeout", detail="timeout")
        except (aiohttp.ClientError, OSError) as exc:
            return Outcome("retry", None, "network", detail=type(exc).__name__)
        finally:
            self.metrics.report_seconds.observe(max(0.0, self.clock.monotonic() - started))
        outcome = classify(status, retry_after, self.settings.retry_statuses)
        if status in (401, 403):
            self.tokens.invalidate()
            logger.error("usage endpoint refused the bearer token (HTTP %d); check the usage token secret",
                         status)
        return Outcome(outcome.kind, outcome.status, outcome.error, outcome.retry_after, detail.strip())

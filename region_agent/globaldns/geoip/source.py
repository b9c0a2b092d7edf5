"""Where the GeoIP database comes from, and keeping it fresh without a pause in answers.

Sources (``dns.geoip.source``):

* ``default`` — the platform-wide URL ``dns.geoip.default_url`` (for example a mirror of DB-IP's
  "IP to City Lite");
* ``url`` — the operator's own URL ``dns.geoip.url``, which may be presigned: its query string
  (``X-Amz-Signature=…``) and any user:password are secrets;
* ``file`` — a mounted file ``dns.geoip.file`` (or the older ``dns.geoip_database``): no network
  at all, for offline installs;
* ``none`` — no database: proximity projects answer every healthy address.

Unset, the source is ``file`` when a file is named, else ``default`` when a default URL is set,
else ``none``. The database is a MaxMind-format *city* database, gzipped or not (gzip is
recognised by its magic bytes, so a ``.gz`` name and a transparent ``Content-Encoding`` both work).

A URL is downloaded at start — unless the last good download in ``cache_dir`` is younger than
``refresh_interval``, which is then used as it is — and again every ``refresh_interval``. A
download is bounded (connect, read-stall and total timeouts; ``max_bytes`` for the download and
for the decompressed file), written to a temporary file in ``cache_dir``, decompressed and
validated off the event loop (opens as a MaxMind city database, lookups work, size bounded) and
only then renamed over the cached copy. The new database replaces the old one through
``install`` (:meth:`region_agent.globaldns.service.ZoneService.replace_geo_database`, which builds the new
proximity map in a thread and swaps a reference), so answers never wait for it. A failed download
keeps the database the agent had, is shown next to it (``refresh_error``) and is retried after
``retry_interval``; at the next start the cached copy is used when the URL fails.

A file source is re-read when its size, mtime or inode changes (looked at every
``settings_poll_interval`` and on SIGHUP). The source itself can change without a restart: the
agent re-reads its settings file on SIGHUP and every ``settings_poll_interval``
(:attr:`GeoipSource.settings_loader`).

Secrets: a URL is shown only through :func:`redact_url` (scheme, host, port and path; the query
becomes ``?<redacted>``), error messages are built here and passed through :func:`scrub`, and
the settings hold URLs as ``SecretStr`` so ``check-config`` prints ``**********``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import enum
import gzip
import hashlib
import logging
import os
import tempfile
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv6Address
from pathlib import Path
from typing import Any, Final
from urllib.parse import unquote_plus, urlsplit

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from region_agent.globaldns.geoip.proximity import GeoDatabase, GeoDatabaseError

__all__ = [
    "GeoipSettings",
    "GeoipSource",
    "GeoipSourceError",
    "GeoipSourceKind",
    "GeoipStatus",
    "Source",
    "download",
    "prepare_database",
    "redact_url",
    "resolve_source",
    "scrub",
]

logger = logging.getLogger("region_agent.geoip")

_GZIP_MAGIC: Final = b"\x1f\x8b"
_CHUNK: Final = 1 << 16
_REDACTED: Final = "<redacted>"
# Addresses looked up to prove a new database answers (any answer, located or not, will do).
_PROBES: Final = (IPv4Address("1.1.1.1"), IPv4Address("8.8.8.8"), IPv4Address("203.0.113.1"),
                  IPv6Address("2001:4860:4860::8888"), IPv6Address("2a00:1450::1"))


class GeoipSourceKind(enum.StrEnum):
    DEFAULT = "default"
    URL = "url"
    FILE = "file"
    NONE = "none"


class GeoipSettings(BaseModel):
    """Where this region's GeoIP city database comes from (``dns.geoip``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: GeoipSourceKind | None = Field(
        default=None,
        description="default (the platform-wide default_url), url (this region's own url), file (a mounted file) "
        "or none. Unset: file when file or dns.geoip_database is set, else url when url or url_file is set, else "
        "default when default_url is set, else none.")
    default_url: SecretStr | None = Field(
        default=None,
        description="The platform-wide database URL (http or https; .gz or not) used by source default. Treated "
        "as a secret: only its scheme, host and path are ever shown.")
    url: SecretStr | None = Field(
        default=None,
        description="This region's database URL for source url, possibly presigned: its query string is never "
        "logged, stored or shown.")
    url_file: Path | None = Field(
        default=None,
        description="A file holding this region's URL (a mounted Secret), used when url is unset. Read at start "
        "and at every settings re-read, so a re-signed URL needs no restart.")
    file: Path | None = Field(
        default=None,
        description="A mounted database file (gzipped or not) for source file; dns.geoip_database means the same.")
    refresh_interval: float = Field(
        default=30 * 86400, ge=60, description="Seconds between downloads of a URL source (default 30 days).")
    retry_interval: float = Field(
        default=3600, gt=0,
        description="Seconds before a failed download is tried again (the old database stays meanwhile).")
    connect_timeout: float = Field(default=10, gt=0, description="Seconds to connect to the URL's server.")
    read_timeout: float = Field(
        default=60, gt=0, description="Seconds a download may stall (no byte received) before it is given up.")
    download_timeout: float = Field(default=900, gt=0, description="Seconds a whole download may take.")
    max_bytes: int = Field(
        default=512 * 1024 * 1024, ge=1024,
        description="Largest database accepted, downloaded and decompressed alike (GeoLite2-City is ~70 MB).")
    cache_dir: Path | None = Field(
        default=None,
        description="Directory for downloads and the last good copy (reused at the next start when the URL "
        "fails; room for two databases). Unset: region-agent-geoip in the temporary directory.")
    settings_poll_interval: float = Field(
        default=60, ge=0,
        description="Seconds between re-reads of the settings file for a changed source, and looks at a file "
        "source for a new version; 0: only on SIGHUP.")

    @field_validator("default_url", "url")
    @classmethod
    def _http_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            try:
                parts = urlsplit(value.get_secret_value())
            except ValueError:
                raise ValueError("not a URL") from None
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("must be an http or https URL with a host name")  # never echo the value
        return value

    def cache_directory(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else Path(tempfile.gettempdir()) / "region-agent-geoip"


@dataclass(frozen=True, slots=True)
class Source:
    """The effective source: its kind and where it is. ``url`` is secret (left out of repr)."""

    kind: GeoipSourceKind
    url: str | None = field(default=None, repr=False)
    path: Path | None = None

    @property
    def shown(self) -> str:
        """Where the database comes from, safe to log and show."""
        if self.url is not None:
            return redact_url(self.url)
        if self.path is not None:
            return str(self.path)
        return ""


def resolve_source(settings: GeoipSettings, legacy_file: Path | None = None) -> Source:
    """The source ``settings`` mean; ValueError (naming the setting) when its location is missing."""
    file = settings.file if settings.file is not None else legacy_file
    kind = settings.source
    if kind is None:
        if file is not None:
            kind = GeoipSourceKind.FILE
        elif settings.url is not None or settings.url_file is not None:
            kind = GeoipSourceKind.URL
        elif settings.default_url is not None:
            kind = GeoipSourceKind.DEFAULT
        else:
            kind = GeoipSourceKind.NONE
    if kind is GeoipSourceKind.FILE:
        if file is None:
            raise ValueError("geoip.source file needs geoip.file (or geoip_database)")
        return Source(kind, path=file)
    if kind is GeoipSourceKind.URL:
        if settings.url is not None:
            return Source(kind, url=settings.url.get_secret_value())
        if settings.url_file is None:
            raise ValueError("geoip.source url needs geoip.url (or geoip.url_file)")
        return Source(kind, url=_read_url_file(settings.url_file))
    if kind is GeoipSourceKind.DEFAULT:
        if settings.default_url is None:
            raise ValueError("geoip.source default needs geoip.default_url (the platform's database URL)")
        return Source(kind, url=settings.default_url.get_secret_value())
    return Source(GeoipSourceKind.NONE)


def _read_url_file(path: Path) -> str:
    try:
        url = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"geoip.url_file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"geoip.url_file {path}: not UTF-8") from None
    try:
        parts = urlsplit(url)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:
        valid = False
    if not valid:
        raise ValueError(f"geoip.url_file {path}: does not hold an http or https URL with a host name")
    return url


# --- secrets ------------------------------------------------------------------------------


def redact_url(url: str) -> str:
    """``scheme://host[:port]/path``, with ``?<redacted>`` when the URL had a query or fragment.

    User name and password are dropped too. Never raises: an unparseable URL shows as ``<url>``.
    """
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "<url>"
    if ":" in host:
        host = f"[{host}]"
    netloc = host if port is None else f"{host}:{port}"
    shown = f"{parts.scheme}://{netloc}{parts.path}"
    if parts.query or parts.fragment:
        shown += f"?{_REDACTED}"
    return shown


def scrub(text: str, url: str | None) -> str:
    """``text`` with every secret part of ``url`` (whole, query, fragment, credentials) replaced.

    The query is also removed in the spellings an HTTP client may have printed it with
    (percent-encoded or decoded).
    """
    if not url:
        return text
    secrets = {url}
    try:
        parts = urlsplit(url)
        secrets.update((parts.query, parts.fragment, parts.username or "", parts.password or ""))
        for raw in parts.query.split("&"):  # each value alone too (a signature quoted on its own)
            value = raw.partition("=")[2]
            secrets.update((value, unquote_plus(value)) if len(value) >= 4 else ())
    except ValueError:
        pass
    try:
        import yarl

        parsed = yarl.URL(url)
        secrets.update((str(parsed), parsed.raw_query_string, parsed.query_string, parsed.raw_fragment,
                        parsed.fragment, parsed.raw_password or "", parsed.password or ""))
    except (ValueError, TypeError):
        pass
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        if secret == url or secret.startswith(("http://", "https://")):
            text = text.replace(secret, redact_url(url))
        else:
            text = text.replace(secret, _REDACTED)
    return text


# --- fetching and checking a database -------------------------------------------------------


class GeoipSourceError(Exception):
    """A database could not be had; ``code`` is a stable reason, the message is safe to show."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


async def download(url: str, directory: Path, *, connect_timeout: float, read_timeout: float,
                   total_timeout: float, max_bytes: int) -> Path:
    """Download ``url`` into a new temporary file in ``directory`` and return its path.

    Raises :class:`GeoipSourceError` (``http-status``, ``timeout``, ``connect-failed``,
    ``too-large``, ``download-failed``, ``cache-unwritable``), with a message that names the
    URL only in its redacted form; the temporary file is removed on failure.
    """
    shown = redact_url(url)
    try:
        os.makedirs(directory, exist_ok=True)  # a metadata call: not worth a thread
        handle, name = tempfile.mkstemp(dir=directory, prefix=".download-", suffix=".part")
    except OSError as exc:
        raise GeoipSourceError("cache-unwritable", f"cache directory {directory}: {exc.strerror}") from None
    path = Path(name)
    timeout = aiohttp.ClientTimeout(total=total_timeout, sock_connect=connect_timeout, sock_read=read_timeout)
    try:
        with os.fdopen(handle, "wb") as out:
            async with aiohttp.ClientSession(timeout=timeout, trust_env=True) as session, \
                    session.get(url, max_redirects=5) as response:
                if response.status != 200:
                    raise GeoipSourceError("http-status", f"{shown}: HTTP {response.status}")
                if response.content_length is not None and response.content_length > max_bytes:
                    raise GeoipSourceError("too-large", f"{shown}: {response.content_length} bytes is more than "
                                           f"max_bytes {max_bytes}")
                size = 0
                async for chunk in response.content.iter_chunked(_CHUNK):
                    size += len(chunk)
                    if size > max_bytes:
                        raise GeoipSourceError("too-large", f"{shown}: more than max_bytes {max_bytes}")
                    out.write(chunk)
        return path
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(path)
        if isinstance(exc, GeoipSourceError | asyncio.CancelledError):
            raise
        if isinstance(exc, TimeoutError):  # aiohttp's connect and read timeouts are TimeoutErrors too
            raise GeoipSourceError("timeout", f"{shown}: timed out (connect {connect_timeout:g} s, stall "
                                   f"{read_timeout:g} s, total {total_timeout:g} s)") from None
        if isinstance(exc, aiohttp.ClientConnectorError):
            reason = os.strerror(exc.os_error.errno) if exc.os_error.errno else type(exc.os_error).__name__
            raise GeoipSourceError("connect-failed", f"{shown}: can not connect: {reason}") from None
        if isinstance(exc, aiohttp.TooManyRedirects):
            raise GeoipSourceError("download-failed", f"{shown}: too many redirects") from None
        if isinstance(exc, aiohttp.ClientError):
            # Not str(exc): aiohttp's messages carry the (possibly redirected) URL with its query.
            raise GeoipSourceError("download-failed", f"{shown}: {type(exc).__name__}") from None
        if isinstance(exc, OSError):
            raise GeoipSourceError("cache-unwritable", f"cache directory {directory}: {exc.strerror}") from None
        raise


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated database file, opened."""

    database: GeoDatabase
    path: Path
    size: int
    sha256: str


def prepare_database(path: Path, directory: Path, *, max_bytes: int, shown: str) -> Prepared:
    """Decompress ``path`` if it is gzip (into a temporary file in ``directory``), then validate it.

    Blocking (run it in a thread). ``shown`` names the source in messages. Returns the
    opened database and the file it opened (``path`` itself when it was not compressed); a
    temporary file is removed on failure. Raises :class:`GeoipSourceError` (``file-missing``,
    ``too-large``, ``invalid-database``, ``cache-unwritable``).
    """
    try:
        with open(path, "rb") as handle:
            magic = handle.read(2)
    except FileNotFoundError:
        raise GeoipSourceError("file-missing", f"{shown}: no such file") from None
    except OSError as exc:
        raise GeoipSourceError("file-missing", f"{shown}: {exc.strerror}") from None
    opened = path
    temporary = False
    if magic == _GZIP_MAGIC:
        opened = _gunzip(path, directory, max_bytes=max_bytes, shown=shown)
        temporary = True
    try:
        return _validate(opened, max_bytes=max_bytes, shown=shown)
    except BaseException:
        if temporary:
            with contextlib.suppress(OSError):
                opened.unlink()
        raise


def _gunzip(path: Path, directory: Path, *, max_bytes: int, shown: str) -> Path:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(dir=directory, prefix=".gunzip-", suffix=".mmdb")
    except OSError as exc:
        raise GeoipSourceError("cache-unwritable", f"cache directory {directory}: {exc.strerror}") from None
    out_path = Path(name)
    try:
        size = 0
        with os.fdopen(handle, "wb") as out, gzip.open(path, "rb") as compressed:
            while chunk := compressed.read(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise GeoipSourceError("too-large", f"{shown}: more than max_bytes {max_bytes} decompressed")
                out.write(chunk)
        return out_path
    except BaseException as exc:
        with contextlib.suppress(OSError):
            out_path.unlink()
        if isinstance(exc, gzip.BadGzipFile | EOFError | zlib.error):
            raise GeoipSourceError("invalid-database", f"{shown}: not a valid gzip file") from None
        if isinstance(exc, OSError) and not isinstance(exc, GeoipSourceError):
            raise GeoipSourceError("cache-unwritable", f"{shown}: decompressing: {exc.strerror}") from None
        raise


def _validate(path: Path, *, max_bytes: int, shown: str) -> Prepared:
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise GeoipSourceError("file-missing", f"{shown}: {exc.strerror}") from None
    if size > max_bytes:
        raise GeoipSourceError("too-large", f"{shown}: {size} bytes is more than max_bytes {max_bytes}")
    try:
        database = GeoDatabase.open(path)
    except GeoDatabaseError as exc:
        reason = str(exc).replace(str(path), "").lstrip(": ")  # the temporary name says nothing
        raise GeoipSourceError("invalid-database", f"{shown}: not a MaxMind database: {reason}") from None
    try:
        if "city" not in database.database_type.lower():
            raise GeoipSourceError("invalid-database", f"{shown}: database type {database.database_type!r} is "
                                   "not a city database (no locations)")
        for probe in _PROBES:
            database.locate(probe)
        if database.corrupt_records:
            raise GeoipSourceError("invalid-database", f"{shown}: {database.corrupt_records} corrupt record(s) "
                                   "met in test lookups")
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    except GeoipSourceError:
        database.close()
        raise
    except Exception as exc:
        database.close()
        raise GeoipSourceError("invalid-database", f"{shown}: lookups fail: {type(exc).__name__}") from None
    return Prepared(database, path, size, digest.hexdigest())


def cache_path(directory: Path, url: str) -> Path:
    """Where the last good download of ``url`` is kept: keyed by its redacted form.

    A presigned URL whose signature changes at every issue keeps its one cached copy.
    """
    key = hashlib.sha256(redact_url(url).encode()).hexdigest()[:16]
    return directory / f"geoip-{key}.mmdb"


# --- status -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GeoipStatus:
    """What ``/health/region`` (``geoip``), the metrics and ``region-agent geoip`` show.

    ``state``: ``loaded`` (a database answers; a failed refresh is in ``refresh_error``),
    ``missing`` (a source is set but no database could be had: ``error``) or ``off``.
    Every text here is safe to show (URLs are redacted).
    """

    state: str
    source: str
    location: str = ""
    size_bytes: int | None = None
    build_epoch: int | None = None
    database_type: str | None = None
    loaded_at: float | None = None
    from_cache: bool = False
    error_code: str | None = None
    error: str | None = None
    refresh_error_code: str | None = None
    refresh_error: str | None = None
    refresh_failed_at: float | None = None
    next_refresh_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        build_date = None
        if self.build_epoch is not None:
            build_date = datetime.datetime.fromtimestamp(self.build_epoch, datetime.UTC).date().isoformat()
        return {
            "state": self.state, "source": self.source, "location": self.location,
            "size_bytes": self.size_bytes, "build_epoch": self.build_epoch, "build_date": build_date,
            "database_type": self.database_type, "loaded_at": self.loaded_at, "from_cache": self.from_cache,
            "error": None if self.error_code is None else {"code": self.error_code, "message": self.error},
            "refresh_error": None if self.refresh_error_code is None else {
                "code": self.refresh_error_code, "message": self.refresh_error, "at": self.refresh_failed_at},
            "next_refresh_at": self.next_refresh_at,
        }

    def problem(self) -> str | None:
        """One line for the agent's degraded problems while a configured source has no database."""
        if self.state != "missing" or self.error_code == "not-downloaded-yet":  # the first download is under way
            return None
        return f"geoip database missing ({self.error_code}): {self.error}"


@dataclass(slots=True)
class _Loaded:
    source: Source
    size: int
    sha256: str
    build_epoch: int
    database_type: str
    loaded_at: float
    from_cache: bool
    signature: tuple[int, int, int] | None = None  # a file source's (size, mtime_ns, inode)


class _Metrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.state = Gauge("region_agent_geoip_state", "1 for the GeoIP database's state (loaded, missing, off)",
                           ["state"], registry=registry)
        self.source = Gauge("region_agent_geoip_source", "1 for the configured GeoIP source (default, url, file, none)",
                            ["source"], registry=registry)
        self.refreshes = Counter("region_agent_geoip_refresh", "GeoIP database loads and downloads, by result (ok: "
                                 "a new database swapped in, unchanged: the same file again, failed)", ["result"],
                                 registry=registry)
        self.build = Gauge("region_agent_geoip_build_timestamp_seconds",
                           "Build time of the GeoIP database in use (0: none)", registry=registry)
        self.size = Gauge("region_agent_geoip_size_bytes", "Size of the GeoIP database in use (0: none)",
                          registry=registry)
        self.last_success = Gauge("region_agent_geoip_last_success_timestamp_seconds",
                                  "When a GeoIP database was last loaded or confirmed unchanged", registry=registry)
        for state in ("loaded", "missing", "off"):
            self.state.labels(state)
        for result in ("ok", "unchanged", "failed"):
            self.refreshes.labels(result)
        for kind in GeoipSourceKind:
            self.source.labels(kind.value)


Install = Callable[[GeoDatabase | None], Awaitable[None]]


class GeoipSource:
    """Keeps the zone's GeoIP database: loads it at start, refreshes it, follows setting changes.

    ``install`` puts a database (or None) into service; ``on_status`` is called whenever
    :attr:`status` changes (the agent republishes its view). All methods run on the loop;
    :meth:`run` serializes every load, so one happens at a time.
    """

    def __init__(self, settings: GeoipSettings, legacy_file: Path | None, registry: CollectorRegistry | None, *,
                 install: Install, on_status: Callable[[], None] = lambda: None) -> None:
        self.settings = settings
        self.legacy_file = legacy_file
        self.source = resolve_source(settings, legacy_file)
        self._install_cb = install
        self._on_status = on_status
        self._metrics = _Metrics(registry)
        self.database: GeoDatabase | None = None
        self._loaded: _Loaded | None = None
        self._next_refresh: float | None = None
        self._next_poll = 0.0
        self._wake = asyncio.Event()
        self._hup = False
        # Returns the current (geoip settings, legacy geoip_database); set by the agent so the
        # source can change without a restart. May raise (a bad settings file keeps the old).
        self.settings_loader: Callable[[], tuple[GeoipSettings, Path | None]] | None = None
        # What the settings (and a url_file) said when last read: a change is a change of the
        # file, so an agent built from settings given in code is not switched to what it says.
        self._baseline: tuple[GeoipSettings, Path | None, Source | None] = (settings, legacy_file, self.source)
        self.status = GeoipStatus(state="off", source=self.source.kind.value)
        self._publish(self.status)

    # -- status ---------------------------------------------------------------------------

    def problems(self) -> tuple[str, ...]:
        problem = self.status.problem()
        return () if problem is None else (problem,)

    def _publish(self, status: GeoipStatus) -> None:
        self.status = status
        for state in ("loaded", "missing", "off"):
            self._metrics.state.labels(state).set(1 if state == status.state else 0)
        for kind in GeoipSourceKind:
            self._metrics.source.labels(kind.value).set(1 if kind.value == status.source else 0)
        self._metrics.build.set(status.build_epoch or 0)
        self._metrics.size.set(status.size_bytes or 0)
        self._on_status()

    def _loaded_status(self, refresh_error: GeoipSourceError | None = None) -> GeoipStatus:
        loaded = self._loaded
        assert loaded is not None
        return GeoipStatus(
            state="loaded", source=loaded.source.kind.value, location=loaded.source.shown, size_bytes=loaded.size,
            build_epoch=loaded.build_epoch, database_type=loaded.database_type, loaded_at=loaded.loaded_at,
            from_cache=loaded.from_cache, next_refresh_at=self._next_refresh,
            refresh_error_code=None if refresh_error is None else refresh_error.code,
            refresh_error=None if refresh_error is None else str(refresh_error),
            refresh_failed_at=None if refresh_error is None else time.time())

    def _missing_status(self, error: GeoipSourceError) -> GeoipStatus:
        return GeoipStatus(state="missing", source=self.source.kind.value, location=self.source.shown,
                           error_code=error.code, error=str(error), next_refresh_at=self._next_refresh)

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Load what is at hand before the DNS sockets open: the file, or the cached download.

        Never raises for a bad source: the state is then ``missing`` and :meth:`run` tries
        again. A URL with no fresh cached copy is downloaded by :meth:`run` right away.
        """
        if self.settings_loader is not None:
            try:
                self._baseline = await asyncio.to_thread(_read_settings, self.settings_loader)
            except Exception as exc:
                logger.warning("geoip: settings file not read: %s", scrub(str(exc), self.source.url))
        await self._load_source(self.source, at_start=True)

    async def run(self) -> None:
        """Refresh, follow settings and the file, until cancelled."""
        self._next_poll = time.monotonic() + self.settings.settings_poll_interval
        while True:
            delay = self._seconds_to_next()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
            self._wake.clear()
            await self.tick()

    def request_reload(self) -> None:
        """SIGHUP: re-read the settings (a changed source is loaded now) and look at the file again."""
        self._hup = True
        self._wake.set()

    def _seconds_to_next(self) -> float:
        if self._hup:
            return 0.0
        delays = [86400.0]
        if self.settings.settings_poll_interval > 0:
            delays.append(self._next_poll - time.monotonic())
        if self._next_refresh is not None and self.source.url is not None:
            delays.append(self._next_refresh - time.time())
        return max(0.0, min(delays))

    async def tick(self) -> None:
        """One turn of :meth:`run`: what is due now (also for tests, without the loop's timing)."""
        hup, self._hup = self._hup, False
        poll_due = self.settings.settings_poll_interval > 0 and time.monotonic() >= self._next_poll
        if poll_due:
            self._next_poll = time.monotonic() + self.settings.settings_poll_interval
        if (hup or poll_due) and await self._reread_settings():
            return  # a new source was loaded
        if self.source.kind is GeoipSourceKind.FILE and (hup or poll_due) and self._file_changed():
            await self._load_source(self.source)
        elif self.source.url is not None and self._next_refresh is not None and time.time() >= self._next_refresh:
            await self.refresh()

    async def _reread_settings(self) -> bool:
        """Adopt changed settings; True when the source changed (and was loaded)."""
        loader = self.settings_loader
        if loader is None:
            return False
        try:
            settings, legacy, source = await asyncio.to_thread(_read_settings, loader)
        except Exception as exc:  # a bad settings file: keep what we have
            logger.warning("geoip: settings not re-read, keeping source %s %s: %s", self.source.kind.value,
                           self.source.shown, scrub(str(exc), self.source.url))
            return False
        if (settings, legacy, source) == self._baseline:
            return False
        self._baseline = (settings, legacy, source)
        old = self.source
        self.settings, self.legacy_file = settings, legacy
        if source == old:
            return False
        loaded = self._loaded
        if loaded is not None and loaded.source == old and source.kind is old.kind and \
                old.url is not None and source.url is not None and redact_url(source.url) == redact_url(old.url):
            # The same object under a new signature (a presigned URL re-issued): no download now.
            logger.info("geoip: new credentials for %s; the next download uses them", source.shown)
            self.source = loaded.source = source
            return False
        logger.info("geoip: source changed from %s %s to %s %s", old.kind.value, old.shown, source.kind.value,
                    source.shown)
        self.source = source
        await self._load_source(source)
        return True

    def _file_changed(self) -> bool:
        path = self.source.path
        if path is None:
            return False
        signature = _signature(path)
        loaded = self._loaded
        if loaded is None or loaded.source != self.source:
            return True  # missing so far: try again
        return signature != loaded.signature

    async def refresh(self) -> bool:
        """Download the URL source now; True when a database is in service afterwards."""
        source = self.source
        if source.url is None:
            return await self._load_source(source)
        try:
            prepared = await self._fetch(source)
        except GeoipSourceError as exc:
            return self._failed(source, exc)
        if self.source != source:  # changed while downloading: the new source is loaded already
            _discard(prepared)
            return self.database is not None
        return await self._adopt(source, prepared, from_cache=False,
                                 next_refresh=time.time() + self.settings.refresh_interval)

    # -- loading ----------------------------------------------------------------------------

    async def _load_source(self, source: Source, *, at_start: bool = False) -> bool:
        """Put ``source``'s database into service; True when a database answers afterwards."""
        if source.kind is GeoipSourceKind.NONE:
            self._loaded, self._next_refresh = None, None
            await self._put(None)
            self._publish(GeoipStatus(state="off", source=source.kind.value))
            logger.info("geoip: off (source none); proximity projects answer every healthy address")
            return False
        if source.path is not None:
            self._next_refresh = None
            signature = _signature(source.path)
            try:
                prepared = await asyncio.to_thread(
                    prepare_database, source.path, self.settings.cache_directory(),
                    max_bytes=self.settings.max_bytes, shown=source.shown)
            except GeoipSourceError as exc:
                return self._failed(source, exc, signature)
            return await self._adopt(source, prepared, from_cache=False, next_refresh=None, signature=signature)
        assert source.url is not None
        if self._loaded is None or self._loaded.source != source:
            # The last good download of this URL, if any, answers until a new one is had.
            cached = cache_path(self.settings.cache_directory(), source.url)
            try:
                age = time.time() - cached.stat().st_mtime
            except OSError:
                age = None
            if age is not None:
                try:
                    prepared = await asyncio.to_thread(prepare_database, cached, cached.parent,
                                                       max_bytes=self.settings.max_bytes,
                                                       shown=f"cached copy of {source.shown}")
                except GeoipSourceError as exc:
                    logger.warning("geoip: %s", scrub(str(exc), source.url))
                else:
                    fresh = age < self.settings.refresh_interval
                    due = time.time() + (self.settings.refresh_interval - age if fresh else 0.0)
                    await self._adopt(source, prepared, from_cache=True, next_refresh=due)
                    if fresh:
                        return True
        self._next_refresh = time.time()
        if self._loaded is None or self._loaded.source != source:
            pending = GeoipSourceError("not-downloaded-yet", f"{source.shown}: download pending")
            self._publish(self._missing_status(pending) if self.database is None else self._loaded_status(pending))
        if at_start:
            return self.database is not None  # run() downloads now: start() does not wait for the network
        return await self.refresh()

    async def _fetch(self, source: Source) -> Prepared:
        assert source.url is not None
        settings = self.settings
        directory = settings.cache_directory()
        started = time.monotonic()
        raw = await download(source.url, directory, connect_timeout=settings.connect_timeout,
                             read_timeout=settings.read_timeout, total_timeout=settings.download_timeout,
                             max_bytes=settings.max_bytes)
        try:
            prepared = await asyncio.to_thread(prepare_database, raw, directory, max_bytes=settings.max_bytes,
                                               shown=source.shown)
        except BaseException:
            with contextlib.suppress(OSError):
                raw.unlink()
            raise
        if prepared.path != raw:  # decompressed: the download itself is not needed
            with contextlib.suppress(OSError):
                raw.unlink()
        target = cache_path(directory, source.url)
        try:
            os.replace(prepared.path, target)  # atomic; the open database keeps its mapping
        except OSError as exc:
            prepared.database.close()
            with contextlib.suppress(OSError):
                prepared.path.unlink()
            raise GeoipSourceError("cache-unwritable", f"cache directory {directory}: {exc.strerror}") from None
        logger.info("geoip: downloaded %s (%d bytes) in %.1f s", source.shown, prepared.size,
                    time.monotonic() - started)
        return Prepared(prepared.database, target, prepared.size, prepared.sha256)

    async def _adopt(self, source: Source, prepared: Prepared, *, from_cache: bool, next_refresh: float | None,
                     signature: tuple[int, int, int] | None = None) -> bool:
        now = time.time()
        self._next_refresh = next_refresh
        loaded = self._loaded
        if loaded is not None and loaded.source == source and loaded.sha256 == prepared.sha256 and \
                self.database is not None:
            _discard(prepared)  # the same file again: keep the database in service
            loaded.signature = signature
            if source.url is not None:
                with contextlib.suppress(OSError):
                    os.utime(cache_path(self.settings.cache_directory(), source.url))  # fresh again
            self._metrics.refreshes.labels("unchanged").inc()
            self._metrics.last_success.set(now)
            self._publish(self._loaded_status())
            logger.info("geoip: %s unchanged", source.shown)
            return True
        await self._put(prepared.database)
        _drop_temporary(prepared.path)  # a decompressed file source: mapped, its name is not needed
        self._loaded = _Loaded(source, prepared.size, prepared.sha256, prepared.database.build_epoch,
                               prepared.database.database_type, now, from_cache, signature)
        self._metrics.refreshes.labels("ok").inc()
        self._metrics.last_success.set(now)
        self._publish(self._loaded_status())
        logger.info("geoip: %s database %s from %s%s (%d bytes, built %s)", source.kind.value,
                    prepared.database.database_type, source.shown, " (cached copy)" if from_cache else "",
                    prepared.size, self.status.to_dict()["build_date"])
        return True

    async def _put(self, database: GeoDatabase | None) -> None:
        if database is self.database:
            return
        await self._install_cb(database)
        self.database = database  # the previous one is freed with the last map that used it

    def _failed(self, source: Source, error: GeoipSourceError,
                signature: tuple[int, int, int] | None = None) -> bool:
        """Record a failed load of ``source``; True when a (previous) database still answers."""
        self._metrics.refreshes.labels("failed").inc()
        if source.url is not None:
            self._next_refresh = time.time() + min(self.settings.retry_interval, self.settings.refresh_interval)
        message = scrub(str(error), source.url)
        error = GeoipSourceError(error.code, message)
        previous = self.status.refresh_error if self.status.state == "loaded" else self.status.error
        log = logger.warning if message != previous else logger.debug  # a file missing for days: one line
        loaded = self._loaded
        if loaded is not None and self.database is not None:
            if loaded.source == source:
                loaded.signature = signature  # this version of the file failed: wait for the next
                log("geoip: refresh failed, keeping the database loaded at %s: %s",
                    time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(loaded.loaded_at)), message)
            else:
                log("geoip: %s; still answering from the previous database (%s)", message, loaded.source.shown)
            self._publish(self._loaded_status(error))
            return True
        log("geoip: no database: %s", message)
        self._publish(self._missing_status(error))
        return False


def _read_settings(loader: Callable[[], tuple[GeoipSettings, Path | None]],
                   ) -> tuple[GeoipSettings, Path | None, Source]:
    """The settings as the file says now, and the source they mean (a url_file read too). Blocking."""
    settings, legacy = loader()
    return settings, legacy, resolve_source(settings, legacy)


def _discard(prepared: Prepared) -> None:
    prepared.database.close()
    _drop_temporary(prepared.path)


def _drop_temporary(path: Path) -> None:
    if path.name.startswith(".gunzip-"):
        with contextlib.suppress(OSError):
            path.unlink()


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns, stat.st_ino

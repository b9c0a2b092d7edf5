"""Settings of the zone and its DNS server (env ``REGION_AGENT_DNS__<FIELD>``)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from region_agent.globaldns.geoip.source import GeoipSettings, resolve_source
from region_agent.globaldns.wire import name_from_text
from region_agent.state.model import MAX_LABEL_OCTETS, MAX_NAME_OCTETS, AllDownPolicy

# Every name the zone holds below its apex is one label (ns-<region>, <slug>: at most 63 octets), so a
# zone of at most this many octets in wire form leaves room for any of them in 255 (RFC 1035 §2.3.4):
# the records' own checks need not know the zone.
MAX_ZONE_OCTETS = MAX_NAME_OCTETS - (MAX_LABEL_OCTETS + 1)
MAX_ZONE_CHARACTERS = MAX_ZONE_OCTETS - 2   # its presentation form: one length octet more, and the root
# TTL bounds (seconds). Answers: a day at most (longer defeats failover; PowerDNS and most resolvers cap
# their cache at a day). Infrastructure (NS, glue, SOA): a week, a common upper bound for delegations.
MAX_ANSWER_TTL = 86_400
MAX_INFRASTRUCTURE_TTL = 604_800
MAX_SOA_EXPIRE = 3_628_800   # six weeks: above RIPE-203's 1000 hours


class RrlSettings(BaseModel):
    """Response rate limiting for UDP (BIND's RRL; see ``region_agent/globaldns/rrl.py`` and the README).

    Off while ``responses_per_second`` is 0. Recommended: 10 responses, 5 NXDOMAIN and 5
    errors per second, window 15, slip 2.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    responses_per_second: float = Field(
        default=0, ge=0,
        description="Identical answers (same name and type, or NODATA for it) per second to one client network "
        "over UDP before the surplus is dropped or slipped; 0 turns rate limiting off. Recommended: 10.",
    )
    nxdomains_per_second: float | None = Field(
        default=None, gt=0,
        description="NXDOMAIN answers per second to one client network, all names of the zone together (a "
        "random-subdomain flood is one bucket). Default: responses_per_second. Recommended: 5.",
    )
    errors_per_second: float | None = Field(
        default=None, gt=0,
        description="Error answers (REFUSED, FORMERR, SERVFAIL, NOTIMP, BADVERS) per second to one client "
        "network, all names together. Default: responses_per_second. Recommended: 5.",
    )
    window: float = Field(
        default=15, ge=1, le=3600,
        description="Seconds of excess a client network may accumulate: after a flood stops it is answered "
        "again within this many seconds.",
    )
    slip: int = Field(
        default=2, ge=0, le=10,
        description="Every slip-th limited response is sent as a tiny TC=1 reply, so a real resolver retries "
        "over TCP (never limited); the others are dropped. 0 drops all, 1 truncates all.",
    )
    ipv4_prefix: int = Field(default=24, ge=8, le=32, description="IPv4 client network size, in prefix bits.")
    ipv6_prefix: int = Field(default=56, ge=16, le=128, description="IPv6 client network size, in prefix bits.")
    max_buckets: int = Field(
        default=100_000, ge=100,
        description="Buckets kept at most (least recently used out first): bounds memory under a flood from "
        "many spoofed networks, about 200 bytes each.",
    )


class TsigKeySetting(BaseModel):
    """One TSIG key (the same three values cert-manager's RFC 2136 issuer is given)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Key name, as the client names it (cert-manager's `tsigKeyName`).")
    algorithm: str = Field(default="hmac-sha256",
                           description="hmac-md5 (cert-manager's default), hmac-sha1, hmac-sha256 or hmac-sha512; "
                           "cert-manager's spellings (HMACSHA256) work too.")
    secret: str = Field(description="The shared secret, base64 (as in cert-manager's `tsigSecretSecretRef`).")


class AcmeSettings(BaseModel):
    """RFC 2136 UPDATE of ACME DNS-01 challenge TXT records (cert-manager's RFC 2136 solver).

    Off while no key and no keys file is configured (UPDATE then gets NOTIMP). Only TXT records at names whose
    first label is ``_acme-challenge`` below the zone apex can be changed; see the README.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tsig_keys: tuple[TsigKeySetting, ...] = Field(
        default=(), description="Keys UPDATEs may be signed with; several at once for rotation.")
    tsig_keys_file: Path | None = Field(
        default=None,
        description="A YAML or JSON file `{name: {algorithm: ..., secret: ...}}` (a mounted Secret) with more keys; "
        "re-read when it changes, so keys rotate without a restart (an unusable file keeps the current keys). "
        "With a file set, UPDATE is on even while the file holds no key.")
    record_lifetime: float = Field(
        default=86_400, gt=0, description="Seconds a challenge record lives when its delete never comes.")
    max_value_length: int = Field(default=512, ge=1, le=65535, description="Bytes of one TXT record's data.")
    max_records_per_name: int = Field(default=16, ge=1, description="Challenge values at one name.")
    max_records: int = Field(default=1024, ge=1, description="Challenge records in the whole zone.")
    updates_per_second: float = Field(
        default=20, gt=0, description="UPDATEs handled per second (burst twice that); more get REFUSED.")


class DnsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    zone: str = Field(
        default="g.example.com",
        description="The global zone this agent is authoritative for; projects answer as <slug>.<zone>. At most "
        f"{MAX_ZONE_CHARACTERS} characters, so that every name one label below it fits in 255 octets.",
    )
    listen_addresses: tuple[str, ...] = Field(
        default=("127.0.0.1",),
        description="IP literals to answer DNS on, UDP and TCP each (IPv6 sockets are v6-only).",
    )
    port: int = Field(default=53, ge=0, le=65535, description="DNS port; 0 picks a free one (tests).")
    record_ttl: int = Field(
        default=30, ge=1, le=MAX_ANSWER_TTL,
        description="TTL of project A/AAAA answers: how long a resolver may keep sending clients to a copy "
        "that has since failed. Shorter fails over faster and costs more queries. 1 to 86400 (a day).",
    )
    ns_ttl: int = Field(default=3600, ge=1, le=MAX_INFRASTRUCTURE_TTL,
                        description="TTL of NS records and their glue. 1 to 604800 (a week).")
    soa_ttl: int = Field(default=3600, ge=1, le=MAX_INFRASTRUCTURE_TTL,
                         description="TTL of the SOA record. 1 to 604800 (a week).")
    soa_minimum: int = Field(
        default=60, ge=0, le=MAX_ANSWER_TTL,
        description="SOA MINIMUM; the negative-answer TTL is min(soa_ttl, soa_minimum) (RFC 2308 §5). "
        "Longer saves queries for names that do not exist; shorter lets a new project resolve sooner. "
        "0 (negative answers not cached) to 86400.",
    )
    soa_refresh: int = Field(default=3600, ge=1, le=MAX_INFRASTRUCTURE_TTL,
                             description="SOA REFRESH (no secondaries use it here). 1 to 604800.")
    soa_retry: int = Field(default=600, ge=1, le=MAX_INFRASTRUCTURE_TTL, description="SOA RETRY. 1 to 604800.")
    soa_expire: int = Field(default=604800, ge=1, le=MAX_SOA_EXPIRE,
                            description="SOA EXPIRE. 1 to 3628800 (six weeks).")
    soa_mname: str | None = Field(default=None, description="SOA MNAME, a DNS name; default the first "
                                  "ns-<region>.<zone>.")
    hostmaster: str | None = Field(default=None, description="SOA RNAME, a DNS name; default hostmaster.<zone>.")
    udp_payload: int = Field(
        default=1232, ge=512, le=4096,
        description="Largest UDP response we send to an EDNS client (and advertise). 1232 avoids IP "
        "fragmentation on every path (DNS Flag Day 2020; RFC 9715 caps it at 1400).",
    )
    tcp_idle_timeout: float = Field(
        default=10.0, gt=0,
        description="Close a TCP connection this many seconds after its last complete query (or its accept); "
        "bytes of an unfinished query do not count, so a trickle can not keep it open (RFC 7766 §6.2.3).",
    )
    tcp_message_timeout: float = Field(
        default=3.0, gt=0,
        description="Close a TCP connection when a query whose first byte has arrived is not complete this "
        "many seconds later (slow senders holding a slot).",
    )
    tcp_max_connections: int = Field(
        default=512, ge=1,
        description="TCP connections served at once. When all are taken, the longest-idle one is closed to "
        "make room for the newcomer (as Knot and NSD do).",
    )
    tcp_max_connections_per_source: int = Field(
        default=16, ge=1,
        description="TCP connections one source (an IPv4 address, an IPv6 /64) may hold at once; more from "
        "it are closed at accept, so one client can neither fill the slots nor push others out.",
    )
    tcp_write_buffer: int = Field(
        default=16384, ge=1024, le=1 << 24,
        description="Bytes of answers one TCP connection may have waiting for the client to read before the "
        "agent stops reading (and answering) it; it resumes when a quarter is left. Bounds what a client "
        "that sends queries but never reads can cost.",
    )
    tcp_max_in_flight: int = Field(
        default=32, ge=1, le=65535,
        description="Pipelined queries from one TCP connection answered in one go; the rest wait, unread, for "
        "the next turn of the event loop so that UDP and other connections are served in between.",
    )
    response_memo_entries: int = Field(
        default=20000, ge=0,
        description="Rendered responses remembered per zone generation so a repeated query costs a lookup "
        "(case-blind; names that do not exist are not remembered). Memory is about 300 bytes each; 0 turns "
        "the memo off.",
    )
    rrl: RrlSettings = Field(
        default_factory=RrlSettings,
        description="Response rate limiting of UDP answers per client network (off by default).",
    )
    acme: AcmeSettings = Field(
        default_factory=AcmeSettings,
        description="RFC 2136 UPDATE of ACME challenge TXT records, signed with TSIG (off without keys).",
    )
    geoip_database: Path | None = Field(
        default=None,
        description="MaxMind-format city database (GeoLite2-City.mmdb) for proximity projects. Without it a "
        "proximity project answers every healthy address. The same as geoip.file (source file).",
    )
    geoip: GeoipSettings = Field(
        default_factory=GeoipSettings,
        description="Where the GeoIP city database comes from (default URL, this region's URL, a file, or none), "
        "its refresh and its download bounds.",
    )
    workers: int = Field(
        default=1, ge=1, le=64,
        description="Processes answering DNS. 1: the agent's own process answers (as PowerDNS's one receiver "
        "thread). More: that many worker processes answer on the same addresses and port (SO_REUSEPORT, the "
        "kernel spreads flows; only processes of the agent's uid can join), each holding the compiled zone, "
        "kept in step by deltas from the main process, which compiles and holds the store. Raise it when one "
        "core is not enough for the queries (an answer costs 7.5-16.5 µs of CPU by query shape in "
        "bench/dns_throughput.py): at most the cores the pod may use, less one for the main process. Each "
        "worker holds its own copy of the tables (see the globaldns README). Limits per worker: each has its "
        "own dns.rrl buckets, and the kernel sends one source address and port to one worker, but resolvers "
        "and spoofed floods vary their source port, so a client network gets up to N times the dns.rrl rates "
        "in total; the UPDATE forward budget is acme.updates_per_second divided by N per worker (together as "
        "one process).",
    )
    startup_answer: AllDownPolicy = Field(
        default=AllDownPolicy.ALL,
        description="How projects answer before the first health round has finished (the agent is not ready "
        "yet, but a query may still arrive): all = every address (PowerDNS's first query), primary, empty "
        "(NODATA) or servfail (the resolver tries another name server).",
    )

    @field_validator("zone")
    @classmethod
    def _zone(cls, value: str) -> str:
        value = _dns_name(value)
        if not value:
            raise ValueError("the zone can not be the root")
        if len(value) > MAX_ZONE_CHARACTERS:
            raise ValueError(f"the zone is {len(value)} characters, at most {MAX_ZONE_CHARACTERS}: ns-<region>.<zone> "
                             "and <slug>.<zone> (a label of up to 63 octets below it) must fit in 255 octets")
        return value

    @field_validator("soa_mname", "hostmaster")
    @classmethod
    def _soa_name(cls, value: str | None) -> str | None:
        return None if value is None else _dns_name(value)

    @field_validator("listen_addresses")
    @classmethod
    def _addresses(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        for value in values:
            ipaddress.ip_address(value)
        return values

    @model_validator(mode="after")
    def _geoip_source(self) -> DnsSettings:
        resolve_source(self.geoip, self.geoip_database)  # ValueError names the missing setting
        return self


def _dns_name(value: str) -> str:
    """``value`` lower case without the final dot; ValueError when it is not a DNS name."""
    value = value.rstrip(".").lower()
    try:
        name_from_text(value)
    except (ValueError, UnicodeEncodeError) as exc:
        raise ValueError(f"not a DNS name: {exc}") from exc
    return value

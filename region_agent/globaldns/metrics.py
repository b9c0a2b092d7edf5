"""DNS metrics counted with plain integers on the hot path, exported at scrape time.

A prometheus_client ``Counter.labels(...).inc()`` costs about a microsecond, a tenth of
the whole budget of a cached answer, so the answer path bumps dict entries and a custom
collector turns them into ``region_agent_dns_*`` families when Prometheus asks.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

QTYPE_NAMES = {1: "A", 2: "NS", 5: "CNAME", 6: "SOA", 12: "PTR", 13: "HINFO", 15: "MX", 16: "TXT", 28: "AAAA",
               33: "SRV", 35: "NAPTR", 43: "DS", 48: "DNSKEY", 64: "SVCB", 65: "HTTPS", 99: "SPF",
               251: "IXFR", 252: "AXFR", 255: "ANY", -1: "none"}
RCODE_NAMES = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED",
               9: "NOTAUTH", 16: "BADVERS"}
# Seconds; the answer path takes ~2-50 µs, queueing and Python pauses show up above.
LATENCY_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)


class DnsCounters:
    def __init__(self) -> None:
        # (qtype, rcode) → answers; a defaultdict, not a Counter: += on a Counter costs twice as much
        self.answers: defaultdict[tuple[int, int], int] = defaultdict(int)
        self.malformed_reasons: Counter[str] = Counter()
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0
        self.memo_hits = 0
        self.answer_errors = 0  # queries whose answering raised (a bug): dropped, logged at most every 10 s
        self.rrl_actions = [0, 0, 0]  # indexed by region_agent.globaldns.rrl PASS, DROP, SLIP
        self.tcp_connections = 0
        self.tcp_open = 0
        # By reason; the reasons are the ones region_agent.globaldns.server documents.
        self.tcp_refused: Counter[str] = Counter()
        self.tcp_closed: Counter[str] = Counter()
        self.tcp_read_pauses: Counter[str] = Counter()
        self.zone_serial = 0
        self.zone_reloads = 0
        self.zone_errors = 0

    def record(self, qtype: int, rcode: int, seconds: float) -> None:
        self.answers[(qtype, rcode)] += 1
        self.observe(seconds)

    def observe(self, seconds: float) -> None:
        """One latency sample (the Responder times one query in ``latency_sample``)."""
        self.latency_counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds

    def malformed(self, reason: str) -> None:
        self.malformed_reasons[reason.split(":", maxsplit=1)[0]] += 1

    def total(self) -> int:
        return sum(self.answers.values())


class DnsCollector(Collector):
    def __init__(self, counters: DnsCounters) -> None:
        self.counters = counters

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        c = self.counters
        queries = CounterMetricFamily("region_agent_dns_responses", "DNS responses sent, by query type and rcode",
                                      labels=["qtype", "rcode"])
        for (qtype, rcode), count in sorted(c.answers.items()):
            queries.add_metric([QTYPE_NAMES.get(qtype, str(qtype)), RCODE_NAMES.get(rcode, str(rcode))], count)
        yield queries
        malformed = CounterMetricFamily("region_agent_dns_malformed", "Messages refused by the parser, by reason",
                                        labels=["reason"])
        for reason, count in sorted(c.malformed_reasons.items()):
            malformed.add_metric([reason], count)
        yield malformed
        buckets: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip(LATENCY_BUCKETS, c.latency_counts, strict=False):
            running += count
            buckets.append((repr(bound), running))
        running += c.latency_counts[-1]
        buckets.append(("+Inf", running))
        histogram = HistogramMetricFamily("region_agent_dns_answer_seconds",
                                          "Time from receiving a query to having its response, in the agent "
                                          "(sampled: over UDP the mean of each batch read together, over TCP "
                                          "one query in 16)")
        histogram.add_metric([], buckets, c.latency_sum)
        yield histogram
        yield GaugeMetricFamily("region_agent_dns_zone_serial", "Serial of the zone being answered", c.zone_serial)
        yield CounterMetricFamily("region_agent_dns_zone_reloads", "Zone compilations swapped in", c.zone_reloads)
        yield CounterMetricFamily("region_agent_dns_zone_errors",
                                  "Zone source errors (bad zone file, compile problems)", c.zone_errors)
        yield CounterMetricFamily("region_agent_dns_answer_errors",
                                  "Queries whose answering raised an error (a bug): not answered; the log has the "
                                  "traceback, at most one line every 10 s", c.answer_errors)
        yield CounterMetricFamily("region_agent_dns_memo_hits",
                                  "Responses served from the memo of rendered responses", c.memo_hits)
        rrl = CounterMetricFamily("region_agent_dns_rrl_actions",
                                  "UDP responses seen by response rate limiting, by action (pass, drop, slip: "
                                  "sent as a TC=1 reply)", labels=["action"])
        for name, count in zip(("pass", "drop", "slip"), c.rrl_actions, strict=True):
            rrl.add_metric([name], count)
        yield rrl
        yield CounterMetricFamily("region_agent_dns_tcp_connections", "TCP connections accepted",
                                  c.tcp_connections)
        yield GaugeMetricFamily("region_agent_dns_tcp_open", "TCP connections open now", c.tcp_open)
        for name, help_text, counts in (
            ("region_agent_dns_tcp_refused", "TCP connections closed at accept, by reason (source_limit: its "
             "source already holds dns.tcp_max_connections_per_source)", c.tcp_refused),
            ("region_agent_dns_tcp_closed", "TCP connections ended, by reason (client, idle, message_timeout, "
             "bad_message, evicted: the longest idle when all slots were taken, shutdown)", c.tcp_closed),
            ("region_agent_dns_tcp_read_pauses", "Times a TCP connection stopped being read, by reason "
             "(write_buffer: its unsent answers passed dns.tcp_write_buffer; in_flight: more pipelined "
             "queries than dns.tcp_max_in_flight, answered on the next loop turn)", c.tcp_read_pauses),
        ):
            family = CounterMetricFamily(name, help_text, labels=["reason"])
            for reason, count in sorted(counts.items()):
                family.add_metric([reason], count)
            yield family


def register(counters: DnsCounters, registry: CollectorRegistry) -> None:
    registry.register(DnsCollector(counters))

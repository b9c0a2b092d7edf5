#!/usr/bin/env bash
# Installs the Debian packages the tests and benches drive: dig/nsupdate, PowerDNS 4.7 with LUA
# records (the reference the differential test compares against), dnsperf and wrk (benches), and
# prometheus for promtool (the example alert rules and the /metrics format, tests/deploy/), iproute2
# and nftables (network namespaces and cut links, tests/e2e/test_partitions.py), and
# podman, buildah, runc, debootstrap and tini for the image test, whose base image and wheels
# container/prepare-base.sh makes once (it needs the network; the test does not).
set -euo pipefail
packages=(bind9-dnsutils pdns-server pdns-backend-bind dnsperf wrk prometheus podman buildah runc debootstrap tini
          iproute2 nftables faketime)
missing=()
command -v dig >/dev/null 2>&1 || missing+=(bind9-dnsutils)
command -v pdns_server >/dev/null 2>&1 || missing+=(pdns-server)
[[ -n $(find /usr/lib -name libbindbackend.so 2>/dev/null | head -1) ]] || missing+=(pdns-backend-bind)
command -v dnsperf >/dev/null 2>&1 || missing+=(dnsperf)
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)     # network namespaces: tests/e2e/test_partitions.py
command -v nft >/dev/null 2>&1 || missing+=(nftables)     # links cut there
command -v faketime >/dev/null 2>&1 || missing+=(faketime)  # a skewed clock: tests/e2e/test_clocks.py
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
for tool in podman buildah runc debootstrap tini; do command -v $tool >/dev/null 2>&1 || missing+=($tool); done
# Real ACME issuance (tests/e2e/test_acme_certbot.py): Debian 12's certbot 2.1, which signs its SOA
# lookup, its RFC 2136 plugin, and Pebble, an ACME test CA.
packages+=(certbot python3-certbot-dns-rfc2136 pebble)
[[ -x /usr/bin/certbot ]] || missing+=(certbot)
/usr/bin/python3 -c 'import certbot_dns_rfc2136' >/dev/null 2>&1 || missing+=(python3-certbot-dns-rfc2136)
command -v pebble >/dev/null 2>&1 || missing+=(pebble)
# The operator status page in a real headless browser (tests/e2e/test_status_page.py): Debian's
# chromium and its chromedriver, driven over the WebDriver protocol.
packages+=(chromium chromium-driver)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
if (( ${#missing[@]} == 0 )); then
  bash "$(dirname "$0")/../container/prepare-base.sh" || echo "system-packages: no image test cache" >&2
  exit 0
fi
if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "missing system packages: ${missing[*]} (install: apt-get install ${packages[*]})" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${missing[@]}" >/dev/null
# The Debian package may start a pdns service listening on :53; the tests start their own.
# Likewise the prometheus package's server (:9090); the tests only run promtool.
if command -v systemctl >/dev/null 2>&1; then systemctl disable --now pdns >/dev/null 2>&1 || true; fi
if command -v systemctl >/dev/null 2>&1; then systemctl disable --now prometheus >/dev/null 2>&1 || true; fi
bash "$(dirname "$0")/../container/prepare-base.sh" || echo "system-packages: no image test cache" >&2

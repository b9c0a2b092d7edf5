"""ACME DNS-01: TSIG-signed RFC 2136 UPDATEs of ``_acme-challenge`` TXT records."""

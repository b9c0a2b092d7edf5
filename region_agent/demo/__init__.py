"""``region-agent demo``: a zone on loopback with fake copies that fail and recover."""

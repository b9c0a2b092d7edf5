"""The zone file: the standalone source of regions and projects, and a cluster's import."""

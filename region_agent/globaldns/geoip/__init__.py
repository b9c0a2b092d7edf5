"""GeoIP: the database, where it comes from, and the closest healthy region to a client."""

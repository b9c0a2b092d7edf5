"""The one place that imports every component: settings, the supervisor, the store-gossip adapter."""

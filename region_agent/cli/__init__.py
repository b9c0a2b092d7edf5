"""Every ``region-agent`` subcommand; :func:`region_agent.cli.main.main` is the console script."""

import sys

from region_agent.cli.main import main

sys.exit(main())

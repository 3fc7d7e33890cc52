"""`python -m client ...` is the `shardserve` command."""
import sys

from client.cli.main import main

sys.exit(main())

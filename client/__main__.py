"""`python -m client ...` is the `shardserve` command."""
import sys

from client.cli import main

sys.exit(main())

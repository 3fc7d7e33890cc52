"""`python -m shardserve ...` is the `shardserve` command."""

import sys

from shardserve.client.cli.main import main

sys.exit(main())

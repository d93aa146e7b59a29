"""``python -m mpirt.checkpoint``: verify, inspect, reshard and export checkpoints (:mod:`mpirt.checkpoint.cli`)."""
import sys

from mpirt.checkpoint import cli

sys.exit(cli.main())

"""`python -m sarathi ...`: the `sarathi` command (sarathi.cli)."""
import sys

from sarathi.cli import main

sys.exit(main())

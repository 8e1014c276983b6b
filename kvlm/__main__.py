"""`python -m kvlm`: the `kvlm` command."""

from kvlm.cli.main import run

run()

"""`python -m cpn` is the `cpn` command."""

from cpn.cli import main

main()

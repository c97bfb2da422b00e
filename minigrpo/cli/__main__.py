"""`python -m minigrpo.cli ...`: the same as `minigrpo ...` (for a notebook's `sys.executable`)."""

from minigrpo.cli.app import main

main()

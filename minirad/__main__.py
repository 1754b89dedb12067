"""``python -m minirad {generate,batch,serve,explain} ...``: the ``minirad`` command
(:mod:`minirad.entrypoints.cli`)."""

from minirad.entrypoints.cli import main

raise SystemExit(main())

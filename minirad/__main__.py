"""``python -m minirad {generate,batch} ...``: the ``minirad`` command
(:mod:`minirad.entrypoints.cli`)."""

from minirad.entrypoints.cli import main

raise SystemExit(main())

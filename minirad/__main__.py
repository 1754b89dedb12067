"""``python -m minirad {generate,batch} ...``: the ``minirad`` command (:mod:`minirad.cli`)."""

from .cli import main

raise SystemExit(main())

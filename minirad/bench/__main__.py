"""``python -m minirad.bench <benchmark> [options]``: see :mod:`minirad.bench`."""

from . import main

raise SystemExit(main())

"""``python -m minirad.bench <benchmark> [options]``: see :mod:`minirad.bench`."""

from minirad.bench import main

raise SystemExit(main())

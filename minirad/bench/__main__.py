"""``python -m minirad.bench {radix} [options]``: see :mod:`minirad.bench`."""

from . import main

raise SystemExit(main())

"""``python -m minirad.bench {radix,engine} [options]``: see :mod:`minirad.bench`."""

from . import main

raise SystemExit(main())

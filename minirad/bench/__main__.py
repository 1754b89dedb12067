"""``python -m minirad.bench {radix,engine,structured} [options]``: see :mod:`minirad.bench`."""

from . import main

raise SystemExit(main())

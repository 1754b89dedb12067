"""The ``minirad`` command's subcommands, one module each (``generate``, ``batch``, ``serve``,
``explain``): each builds its own subparser (``add_parser``) and runs its command (``run``);
:mod:`minirad.entrypoints.cli` puts them together.

What several commands share is defined once: the argument groups (``options.py``: model and
device, the engine's settings, the two policies, the hierarchical cache), the checks of what a
command reads before the model loads (``inputs.py``), loading the engine (``loading.py``) and
the finish notes (``notes.py``). No module here imports torch at import time: ``--help`` and a
bad argument answer before the engine loads.
"""

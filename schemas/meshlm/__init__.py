"""flatc output (never hand-edited): regenerate with `python -m schemas.build`."""

"""Autosave: the ranks save the run themselves, every N optimizer steps."""

"""Hangs: where each rank is while a call waits, and a hang explained while it waits."""

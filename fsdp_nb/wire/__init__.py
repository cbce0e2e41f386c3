"""The small dataclasses that cross between the notebook and the engines: what a call
carries (``calls``), a save's or load's spec and each rank's outcome (``checkpoint``), a
wrapped model's shard table (``shards``). Both sides import them; they import nothing of
either side.
"""

"""What the user sees and types: the magics (``magics``), the command line (``cli``), the
widgets (``widgets/``), progress bars (``progress``), plain tables (``tables``) and how a
session prints (``session_view``).

``cli`` sits above the ``Session`` façade (it makes sessions); the rest sit below it and
take the session context or plain data. ``progress`` and ``tables`` are the two drawing
primitives the layers below use to print, so they import nothing of fsdp_nb but the wire.
"""

"""What the user types and sees: the magics (``magics``), the command line (``cli``), the
widgets (``widgets/``) and how a session prints (``session_view``).

``cli`` sits above the ``Session`` façade (it makes sessions); the rest sit below it and
take the session context or plain data. The drawing primitives the layers below print
through (tables, progress bars, the live hang diagnosis) are ``fsdp_nb.display``.
"""

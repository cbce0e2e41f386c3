"""What the user sees: the magics (``magics``), the widgets (``widgets/``) and how a
session prints (``session_view``).

They sit below the ``Session`` façade, which offers them, and take the session context or
plain data. The command line (``fsdp_nb.cli``) sits above the façade, since it makes
sessions. The drawing primitives the layers below print through (tables, progress bars,
the live hang diagnosis) are ``fsdp_nb.display``.
"""

"""What the notebook shows while work runs, drawn for every layer above the runtime:
plain tables and byte sizes (``tables``), progress bars for long checkpoint work
(``progress``) and a call's live hang diagnosis (``hang_view``).

The checkpoint driver, the models, recovery and the front ends all print through these;
they import nothing of fsdp_nb but the runtime's hang report and the wire, so no layer
below the front ends reaches up to print.
"""

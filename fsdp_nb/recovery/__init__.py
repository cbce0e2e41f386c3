"""When a rank fails, hangs or dies: the failure policy every session installs
(``failure_policy``), re-forming the group and restarting ranks (``restart``), where each
rank is (``status``) and pdb on the frame that failed (``postmortem``, the notebook side
of ``fsdp_nb.recovery.rank_postmortem``).
"""

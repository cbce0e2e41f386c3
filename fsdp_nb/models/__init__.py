"""Models on the ranks, notebook side: the wrap options (``options``), wrapping and
replaying a wrap (``wrap``, beside ``fsdp_nb.models.rank_wrap``), the notebook's handle on a
wrapped model (``sharded_model``), sending edited code to the ranks (``modules``,
beside ``fsdp_nb.models.rank_reload``), and where its training steps' time goes
(``step_profile``, beside ``fsdp_nb.steps.rank_step_profile``).
"""

"""The types that cross between the notebook and the engines, with the pure functions that
make and check them (``plan_mesh``, ``make_options``, ``decode``): both sides import them;
they import nothing of either side (only the file formats and the errors).

What a call carries (``calls``), a save's or load's spec and each rank's outcome
(``checkpoint``), a wrap's options, mesh and summary (``wrap_options``, ``mesh_plan``,
``wrap``), a wrapped model's shard table (``shards``), an engine's probe (``probe``),
a plan's jobs and answers (``memory_plan``), a rank's memory (``memory_sample``) and where
it waits (``hang_state``), a resize (``resize``), a reload (``modules``), a post-mortem step
(``postmortem``). What comes back as JSON over a side channel is decoded strictly
(``decode``): a field renamed on one side fails loudly, naming it.
"""

"""The notebook's hold on the engines: launching and connecting them, the rank <-> engine
map and process control (``cluster``, ``launch_settings``, ``standby``), forming the
process group (``rendezvous``), sending calls and gathering results in rank order
(``dispatch``, ``call_channel``, ``calls``, ``shipping``), their health hooks
(``health``) and the session's state machine (``lifecycle``).

It knows nothing of sessions, models or checkpoints: everything above takes a
``SessionContext`` built from these parts.
"""

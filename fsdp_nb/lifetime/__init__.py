"""A session's life beyond one call: starting, connecting, attaching and stopping it
(``start_stop``), its record on disk (``record``), keeping the engines past the kernel
(``keepalive``), the watchdog that stops them when the kernel dies (``watchdog``), and
taking them back in a new kernel (``attach``).
"""

"""``sess.reload``: edited module code to every rank and to the notebook.

A user edits ``mymodule.py`` while the session runs; the engines imported the old
code. ``reload`` checks first that the module is imported somewhere (a clear error
otherwise, nothing done), then reloads it on every rank that imported it and in
the notebook (``fsdp_nb.models.rank_reload``), so the next cell, ``run`` or ``wrap``
uses the edited code while models already built keep theirs.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ..engine.namespace import user_ns
from . import rank_reload as _mod

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["reload"]


def reload(ctx: SessionContext, module: str) -> list[int]:
    """Reload ``module`` on every rank that imported it and in the notebook; returns
    the ranks it was reloaded on."""
    if not isinstance(module, str) or not all(p.isidentifier() for p in module.split(".")):
        raise ValueError(f"reload() needs a module name such as 'mymodule', got {module!r}")
    d = ctx.dispatcher
    have = d.gather(d.apply(f"is {module!r} imported", _mod.imported, args=(module,)))
    ranks = [r for r, yes in enumerate(have) if yes]
    here = module in sys.modules
    if not ranks and not here:
        raise ValueError(
            f"module {module!r} is not imported on any rank nor in the notebook, so there is "
            f"nothing to reload; import it first (e.g. %%px import {module})"
        )
    if ranks:
        d.gather(d.apply(f"reload({module!r})", _mod.reload_on_rank, args=(module,), ranks=ranks))
    if here:
        _mod.reload_here(module, user_ns())
    return ranks

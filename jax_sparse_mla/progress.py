"""The package's progress bars (the serving loop, precompile, checkpoint loading, the demo): shown
by default only where they render, so that logs stay free of their carriage-return refreshes."""

from __future__ import annotations

import sys

import numpy as np
from tqdm.auto import tqdm


def show_progress(progress: bool | None) -> bool:
    """Whether a bar is shown: `progress` (a bool), or for None, the default of every `progress=`
    argument here, whether sys.stderr (where tqdm writes) is a terminal. Why: a bar redraws itself
    with carriage returns, which a log file, CI output or a captured stream keeps as one long line
    of partial refreshes. (A notebook's stderr is no terminal either: pass progress=True there to
    get the bar.) ValueError naming `progress` for another value."""
    if progress is None:
        return sys.stderr is not None and sys.stderr.isatty()
    if not isinstance(progress, (bool, np.bool_)):
        raise ValueError(f"progress must be True, False or None (None: shown when stderr is a terminal), "
                         f"got {progress!r}")
    return bool(progress)


def progress_bar(iterable=None, *, progress: bool | None, **options):
    """tqdm.auto.tqdm(iterable, **options), disabled unless show_progress(progress)."""
    return tqdm(iterable, disable=not show_progress(progress), **options)

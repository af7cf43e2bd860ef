"""Progress bars: off by default where stderr is no terminal (a log, CI output, a captured stream),
so that no carriage-return refresh lands there; on where it is one, or when asked."""

import io
import sys

import jax
import numpy as np
import pytest

from jax_sparse_mla import MLAConfig
from jax_sparse_mla.precompile import precompile
from jax_sparse_mla.progress import show_progress
from jax_sparse_mla.serving import Engine, RequestSpec
from tests.support import scored_plan

TINY = MLAConfig.tiny()


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_default_follows_whether_stderr_is_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert show_progress(None) is False
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert show_progress(None) is True
    assert show_progress(False) is False and show_progress(True) is True
    with pytest.raises(ValueError, match=r"progress must be True, False or None .*got 1"):
        show_progress(1)


def test_precompile_writes_no_bar_into_a_captured_stderr_by_default(capsys):
    plan, _ = scored_plan(TINY)
    identity = jax.jit(lambda x: x)  # a trivial program a plan: the bar is what is tested
    kw = dict(plans=[plan] * 3, num_pages=8, max_num_seqs=2, max_num_batched_tokens=16, method="aot",
              program=lambda plan: (identity, (np.zeros(2, np.float32),), {}))
    precompile(TINY, **kw)
    assert "\r" not in capsys.readouterr().err
    precompile(TINY, **kw, progress=True)  # asked for: the bar, with its refreshes
    assert "\r" in capsys.readouterr().err


def test_engine_run_writes_no_bar_into_a_captured_stderr_by_default(capsys):
    engine = Engine(TINY, num_layers=1, num_pages=8)
    engine.run([RequestSpec(0, 3, 2)])
    assert "\r" not in capsys.readouterr().err
    engine.run([RequestSpec(0, 3, 2)], progress=True)
    assert "\r" in capsys.readouterr().err

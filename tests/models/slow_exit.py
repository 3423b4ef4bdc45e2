"""The MLP example whose process lingers in its exit: after the interpreter has put the
default signal handlers back, while it clears its modules (the seconds torch's teardown
takes), it creates ``<exit_marker>.<pid>`` and sleeps ``exit_sleep`` seconds, so that a test
can send a signal exactly there."""
import os
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "models"))
import mlp  # noqa: E402

DEFAULTS = {**mlp.DEFAULTS, "exit_marker": "", "exit_sleep": 3.0}
OWN = ("exit_marker", "exit_sleep")


class _Lingers:
    """Deleted when the interpreter clears its modules: after ``atexit`` and after the
    signal handlers were reset (CPython's Py_FinalizeEx). It lives in a module of its own:
    the model file is imported again by every look at it, and its old globals go."""

    def __init__(self, marker, seconds):
        self.marker, self.seconds = marker, seconds

    def __del__(self, open=open, sleep=time.sleep, getpid=os.getpid):
        open(f"{self.marker}.{getpid()}", "w").close()
        sleep(self.seconds)


def build(hparams):
    holder = sys.modules.setdefault("slow_exit_lingers", types.ModuleType("slow_exit_lingers"))
    if hparams.get("exit_marker") and not hasattr(holder, "lingers"):
        holder.lingers = _Lingers(hparams["exit_marker"], hparams.get("exit_sleep", 3.0))
    return mlp.build({k: v for k, v in hparams.items() if k not in OWN})

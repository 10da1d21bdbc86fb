"""Run at the start of each rank's script, and only there: the rank wrapper puts this directory first on the
script's PYTHONPATH (as opentelemetry-instrument and ddtrace-run put theirs), so Python imports this file while
it starts. It registers faulthandler for the signal the wrapper sends on the launcher's --timeout, on which the
script writes the stacks of all its threads to its stderr, the rank's log, even with every thread stuck in C.
Then it leaves no trace: sys.path and PYTHONPATH as the script would have had them (the processes it starts do
not register the signal), and the sitecustomize this one hides, if any, imported in its place.
"""

import faulthandler
import os
import sys


def _install() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    signum = os.environ.pop("ZERO8_LAUNCH_STACKS_SIGNAL", "")
    path = os.environ.get("PYTHONPATH", "")
    if path == here:
        del os.environ["PYTHONPATH"]
    elif path.startswith(here + os.pathsep):
        os.environ["PYTHONPATH"] = path[len(here) + 1:]
    sys.path[:] = [p for p in sys.path if not p or os.path.abspath(p) != here]
    if signum.isdigit():
        faulthandler.register(int(signum), all_threads=True)
    import importlib.machinery
    import importlib.util

    hidden = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if hidden is not None and hidden.loader is not None:
        # Replaces this module in sys.modules, which the import of sitecustomize then returns.
        module = importlib.util.module_from_spec(hidden)
        sys.modules["sitecustomize"] = module
        hidden.loader.exec_module(module)


_install()

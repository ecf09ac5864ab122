"""How inductor's CUDA graph trees ran a compiled step (mode "reduce-overhead"): replayed from a recorded graph,
recorded, run as compiled code while warming up, or run without a graph at all.

Inductor falls back to the compiled code without a graph, silently apart from a debug log, when a step mutates an
input that is neither a parameter, a buffer nor a tensor marked static (a cache's tensors are marked), or when a
function is re-recorded more often than `triton.cudagraph_unexpected_rerecord_limit`. Such a step pays every
kernel launch on the host, which a captured decode's tokens/s cannot tell from a slow graph. Counted by wrapping
the tree manager's methods for the duration of a `with counting() as runs:` block:

- calls: the manager's runs of a compiled function (its re-entries, a run handing itself over, counted once);
- replayed: runs of a recorded graph (execute_node);
- recorded: graphs recorded (record_function);
- warm_up: runs as compiled code before recording (run_eager);
- without_graph: the rest, calls - replayed - recorded - warm_up.

All zeros where no CUDA graph ran (a CPU, the eager backend); empty where the installed torch lacks the manager or
one of these methods (its internals are not a public API).
"""

from __future__ import annotations

import contextlib
import functools

COUNTED = {"calls": "run", "replayed": "execute_node", "recorded": "record_function", "warm_up": "run_eager"}


def tree_manager_class():
    """torch's CUDA graph tree manager class, or None where this torch has none."""
    try:
        from torch._inductor.cudagraph_trees import CUDAGraphTreeManager
    except ImportError:
        return None
    return CUDAGraphTreeManager


@contextlib.contextmanager
def counting(manager_class=None):
    """Yields a dict filled as the block runs (see the module's docstring); the methods are restored on exit."""
    manager_class = tree_manager_class() if manager_class is None else manager_class
    runs: dict = {}
    if manager_class is None or not all(callable(getattr(manager_class, m, None)) for m in COUNTED.values()):
        yield runs
        return
    runs.update(dict.fromkeys(COUNTED, 0))
    originals = {name: manager_class.__dict__.get(method) for name, method in COUNTED.items()}
    depth = [0]

    def counted(name: str, method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            outermost = name != "calls" or depth[0] == 0
            runs[name] += outermost
            depth[0] += name == "calls"
            try:
                return method(*args, **kwargs)
            finally:
                depth[0] -= name == "calls"

        return wrapper

    for name, method in COUNTED.items():
        setattr(manager_class, method, counted(name, getattr(manager_class, method)))
    try:
        yield runs
    finally:
        for name, method in COUNTED.items():
            if originals[name] is None:
                delattr(manager_class, method)
            else:
                setattr(manager_class, method, originals[name])
        runs["without_graph"] = runs["calls"] - runs["replayed"] - runs["recorded"] - runs["warm_up"]

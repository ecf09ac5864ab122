"""benchmarks.cuda_graph_runs on a stand-in for inductor's CUDA graph tree manager (the real one needs a GPU; the
GPU check's captured decode rows use it there): each kind of run counted once, a run handing itself over counted
as one call, the rest named as runs without a graph, the methods restored (the page's column:
tests/project/test_gpu_check.py)."""

from __future__ import annotations

from benchmarks import cuda_graph_runs


class StandInManager:
    """The tree manager's flow: run -> _run, which replays, records, warms up, re-enters run, or falls back to the
    compiled code without a graph."""

    def run(self, inputs, function_id):
        return self._run(inputs, function_id)

    def _run(self, inputs, function_id):
        if function_id == "re-enter":
            return self.run(inputs, "replay")
        if function_id == "replay":
            return self.execute_node(None, inputs)
        if function_id == "record":
            return self.record_function(inputs, function_id)
        if function_id == "warm":
            return self.run_eager(inputs, function_id)
        return "compiled code, no graph"

    def execute_node(self, node, inputs):
        return "replayed"

    def record_function(self, inputs, function_id):
        return "recorded"

    def run_eager(self, inputs, function_id):
        return "warmed up"


def test_each_kind_of_run_is_counted_and_the_rest_ran_without_a_graph():
    manager = StandInManager()
    methods = ("run", "execute_node", "record_function", "run_eager")
    originals = {name: StandInManager.__dict__[name] for name in methods}
    with cuda_graph_runs.counting(StandInManager) as runs:
        outputs = [manager.run([], kind) for kind in ("warm", "record", "replay", "replay", "re-enter", "no graph",
                                                      "no graph")]
    assert outputs[:3] == ["warmed up", "recorded", "replayed"] and outputs[-1] == "compiled code, no graph"
    assert runs == {"calls": 7, "replayed": 3, "recorded": 1, "warm_up": 1, "without_graph": 2}
    assert {name: StandInManager.__dict__[name] for name in originals} == originals
    with cuda_graph_runs.counting(StandInManager) as again:
        manager.run([], "replay")
    assert again["calls"] == 1 and again["without_graph"] == 0  # counts start afresh, one wrapper deep


def test_a_manager_without_the_counted_methods_gives_no_counts():
    class Older:
        def run(self, inputs, function_id):
            return "ran"

    with cuda_graph_runs.counting(Older) as runs:
        assert Older().run([], 0) == "ran"
    assert runs == {} and "execute_node" not in Older.__dict__


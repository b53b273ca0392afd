"""A decode step's walk, from the scheduler to the MoE combine and back, in at most 9 files, the ones
docs/design.md ("One step") lists: every file with a function on the call stack while the step is
planned, while its MoE combines run, while its tokens are drawn and while the scheduler takes them
(the real engine on the built-in model, one rank: there the combine is the identity, at more ranks
it is ``Transport.allsum`` of eprt/comm/transport.py, which the list holds)."""

import inspect
import pathlib
import re

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.engine.sampler import RowSampler
from eprt.model.moe_model import MoEModel
from eprt.scheduler import lanes
from eprt.scheduler.scheduler import Scheduler

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMBINE = "eprt/comm/transport.py"  # Transport.allsum: the combine at more than one rank


def documented() -> list[str]:
    """The files docs/design.md lists for a decode step's walk."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text[text.index("<!-- decode walk -->") : text.index("<!-- /decode walk -->")]
    return re.findall(r"^\d+\. `(eprt/[\w/]+\.py)`", block, flags=re.M)


def stack_files() -> set[str]:
    """The package's files on the call stack, from Scheduler.step down (the engine's loop above it is not the walk)."""
    frames = [f.filename for f in inspect.stack()]
    top = max(i for i, f in enumerate(frames) if f.endswith("eprt/scheduler/scheduler.py"))
    return {str(pathlib.Path(f).relative_to(ROOT)) for f in frames[1 : top + 1] if "/eprt/" in f}


def test_a_decode_step_walks_at_most_nine_files_and_docs_design_lists_them(monkeypatch):
    seen, planning = set(), set()
    decoding = {"on": False}

    def spy(cls, name, into):
        inner = getattr(cls, name)

        def wrapped(*args, **kwargs):
            if decoding["on"] or into is planning:
                into.update(stack_files())
            return inner(*args, **kwargs)

        monkeypatch.setattr(cls, name, wrapped)

    def plan_decode(sched, inner=lanes.plan_decode):
        planning.clear()
        plan = inner(sched)
        if plan.decode is not None:  # a decode step: its planning is part of the walk
            decoding["on"] = True
            seen.update(planning)
        return plan

    def update(self, plan, result, inner=Scheduler.update):
        inner(self, plan, result)
        decoding["on"] = False

    spy(lanes, "_make_room", planning)
    spy(MoEModel, "_combine", seen)
    spy(RowSampler, "greedy", seen)
    spy(Scheduler, "_accept", seen)
    monkeypatch.setattr(lanes, "plan_decode", plan_decode)
    monkeypatch.setattr(Scheduler, "update", update)
    with launch_engine(EngineConfig(device="cpu", max_batch=2)) as engine:
        engine.generate([GenerationRequest([5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True))] * 2)
    walk = seen | {COMBINE}
    listed = documented()
    assert len(listed) <= 9 and walk <= set(listed), (sorted(walk), listed)
    assert walk >= {"eprt/scheduler/lanes.py", "eprt/engine/runner.py", "eprt/model/moe_model.py"}
    assert "eprt/engine/sampler.py" in walk

"""Draw the README's picture: the plan `libra_jax.explain` predicts for examples/transformer.py.

    python tools/plan_picture.py        # writes docs/images/plan.png and docs/images/plan.json

The example at the demo's size (``build(small=False)``, the README's demo command), on 8 host
CPU devices, profile ``cpu-host``: the Gantt chart of its first planned scope
(`libra_jax.gantt`), and beside it the plan lines it shows (`tests/plan_fixture.py`'s
`example_plan`, equation positions stripped). tests/test_docs.py regenerates those lines and
fails when the plan changed and the picture was not redrawn.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "images"
EXAMPLE = {"name": "transformer", "small": False, "profile": "cpu-host"}


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    from libra_jax.config import xla_flags

    os.environ["XLA_FLAGS"] = xla_flags(8)
    import libra_jax
    from libra_jax import gantt

    fixture = load(ROOT / "tests" / "plan_fixture.py", "plan_fixture")
    lines = fixture.example_plan(EXAMPLE["name"], small=EXAMPLE["small"])
    common = load(ROOT / "examples" / "common.py", "common")
    step, args = common.load_example(EXAMPLE["name"]).build(EXAMPLE["small"])
    explained = libra_jax.explain(step, *args, profile=EXAMPLE["profile"], file=None)
    scope = explained.scopes[0]
    timeline = gantt.timeline(list(scope.layers), list(scope.buckets), scope.cost)
    OUT.mkdir(parents=True, exist_ok=True)
    gantt.draw(timeline, OUT / "plan.png", key_unit=scope.key_unit.replace("_", " "),
               title=f"examples/transformer.py on 8 CPU devices ({scope.profile}): "
                     f"{len(scope.layers)} gradient psums, {len(scope.buckets)} buckets, "
                     f"{timeline.backward_s * 1e3:.1f} ms backward predicted")
    (OUT / "plan.json").write_text(json.dumps({**EXAMPLE, "plan_lines": lines}, indent=1) + "\n")
    print(f"wrote {OUT / 'plan.png'} and {OUT / 'plan.json'}")


if __name__ == "__main__":
    main()

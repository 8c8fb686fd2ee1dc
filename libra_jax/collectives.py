"""The collective kinds, one row each, every name of a kind written once.

A row is what the layers above know of a kind: the `jax.lax` function it serves (its name in
errors, reports and `explain`), the model's name for it (`model.COLLECTIVE_SHAPES`' key, the
planner's, the engine's in its call records), its value of the engine's enum
(``libra::Collective``, cpp/libra/dtype.h), its layout, and the stem of its FFI targets' names.
The targets' names follow from a row and an engine by one rule (`Collective.target`), the rule
xla_ffi/registry.cc's table follows (tests/test_collectives.py checks every registered name).

Adding a collective (all-to-all, say) starts here: a row, then the engine's (``kLayouts[]`` in
cpp/libra/dtype.h, ``kKinds[]`` in cpp/libra/engine.cc, the targets in xla_ffi/registry.cc),
the model's (`model.COLLECTIVE_SHAPES`), its op over `libra_jax.ops.lowering.rule` and, for
`optimize`, its site rule (docs/architecture.md, "Adding a collective", walked by
tests/test_collectives.py).

Layer 1: pure Python, no JAX.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["Collective", "Shape", "ROWS", "BY_LAX", "BY_KIND", "KINDS", "ENGINES", "PHASES",
           "LAYOUTS", "REFERENCE", "FORMS", "NoForm", "lax_name", "done_target", "of_primitive", "row_of"]

#: The engines a collective's FFI target may name: the CPU engine, libra's CUDA P2P kernels
#: (their targets say "cuda"), NCCL on libra's stream.
ENGINES = ("cpu", "cuda", "nccl")
#: A call in one piece (""), or the two halves of a start/done pair.
PHASES = ("", "start", "done")
#: How each layout spreads a collective's full buffer over the ranks.
LAYOUTS = ("replicated", "scattered", "gathered", "exchanged")


#: The forms a kind's row may hold, provided by the layer that defines each (`Collective.provide`)
#: and asked for where it is used (`Collective.form`): its libra primitive ("primitive", ops/),
#: its JAX primitive's mirror for the sharded ops ("mirror", `ops.sharded`), a bucket of it as
#: one call ("bucket", `ops.fused`), its start/done pair ("pair", `ops.start_done`), what the
#: members of one bucket share ("bucket class", `rewrite.sites`) and the equation `optimize`
#: issues for one site ("emitter", `rewrite.edits`). A kind without a form is refused where the
#: form is asked for, by its name and the form's (`NoForm`): never issued as another kind.
FORMS = ("primitive", "mirror", "bucket", "pair", "bucket class", "emitter")


class NoForm(NotImplementedError):
    """A collective kind asked for a form its row does not hold (`FORMS`)."""


class Shape(NamedTuple):
    """What one collective over ``n`` ranks does with an unsharded buffer of ``b`` bytes (a
    reduce-scatter's input, an all-gather's output): as a ring (NCCL's ``nsteps`` and bus
    bandwidth factors), ``steps(n)`` hop latencies and ``bus_fraction(n) * b`` bytes through each
    rank's link; in the CPU engine (not a ring: each range is reduced or copied by one worker
    from all ranks' buffers), ``engine_traffic(n) * b`` bytes of memory read and written in all.
    The model's terms of a kind (`libra_jax.model`)."""

    steps: Callable[[int], int]
    bus_fraction: Callable[[int], float]
    engine_traffic: Callable[[int], float]


@dataclass(frozen=True, eq=False)
class Collective:
    """One collective kind: every layer reads what it knows of a kind here, and passes the row
    itself (never its name) between functions, sites, plans and primitives' params. One
    object per kind, equal (and hashed and ordered) as the model's name for it, `kind`;
    printed as its `jax.lax` name, as a jaxpr shows it in a primitive's params."""

    #: The `jax.lax` function it serves: "psum", "psum_scatter", "all_gather".
    lax: str
    #: The model's, planner's and engine's name: "all-reduce", "reduce-scatter", "all-gather".
    kind: str
    #: Its value of ``libra::Collective`` (cpp/libra/dtype.h).
    enum: int
    #: "replicated": every rank brings the whole buffer and gets the whole result;
    #: "scattered": every rank brings the whole buffer and keeps its shard of the result;
    #: "gathered": every rank brings its shard and gets the whole buffer;
    #: "exchanged": every rank brings a buffer of one segment per rank (in each row) and gets
    #: one segment from every rank: its segment of theirs (the all-to-all).
    layout: str
    #: Its FFI targets' names start ``libra_<stem>_``.
    stem: str
    #: The model's terms (`Shape`).
    shape: Shape
    #: The key of its measured traffic in a fair-share profile, its seconds over the
    #: all-reduce's for the same buffer (``fair_share.<key>``; `model.collective_traffic`);
    #: None for the all-reduce, the reference every other kind is measured against (another
    #: kind without one is refused where the fair-share form prices it).
    traffic_key: str | None
    #: Its mark after a bucket's number in the Gantt chart (`libra_jax.gantt`).
    label: str
    #: JAX's primitives (their names) that bind it: psum's two, all_gather's two.
    jax_primitives: tuple[str, ...] = ()
    #: Its forms (`FORMS`) by the layers above, filled as they import (`provide`).
    forms: dict[str, Any] = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        return self.lax

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        # A report's ``plan.collective`` held the model's name before it held the row: equal
        # to that name (hashed as it, ordered as it) so that ``== "all-gather"``, a set of them
        # and a sort keep their meaning, as a NumPy dtype equals its name.
        if isinstance(other, str):
            return other == self.kind
        return self is other

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.kind)

    def __lt__(self, other: object) -> bool:
        if isinstance(other, (Collective, str)):
            return self.kind < str(getattr(other, "kind", other))
        return NotImplemented

    def provide(self, form: str, value: Any) -> Any:
        """Gives this kind `form` (one of `FORMS`): called once by the module that defines
        it, as it is imported. Returns `value` (a decorator's use)."""
        if form not in FORMS:
            raise ValueError(f"no form {form!r} of a collective (collectives.FORMS: {FORMS})")
        self.forms[form] = value
        return value

    def form(self, form: str) -> Any:
        """This kind's `form` (`FORMS`); `NoForm` naming the kind and the form where its row
        holds none."""
        if form not in FORMS:
            raise ValueError(f"no form {form!r} of a collective (collectives.FORMS: {FORMS})")
        try:
            return self.forms[form]
        except KeyError:
            raise NoForm(f"the {self.kind} collective ({self.lax}) has no {form} (its row in "
                         "libra_jax/collectives.py holds none: docs/architecture.md, \"Adding a "
                         "collective\")") from None

    def has(self, form: str) -> bool:
        """Whether this kind's row holds `form`."""
        return form in self.forms

    @property
    def name(self) -> str:
        """The `jax.lax` name (`lax`): the key of `BY_LAX`."""
        return self.lax

    @property
    def gathers(self) -> bool:
        """Its operand is one rank's shard; the full buffer is its result."""
        return self.layout == "gathered"

    @property
    def scatters(self) -> bool:
        """Its operand is the full buffer; one rank's shard of it is its result."""
        return self.layout == "scattered"

    @property
    def exchanges(self) -> bool:
        """Every rank sends one segment of its buffer to each rank (the all-to-all)."""
        return self.layout == "exchanged"

    @property
    def sums(self) -> bool:
        """It adds the ranks' elements (of the dtypes the engine sums); else it copies them,
        by their bytes (any dtype of whole bytes)."""
        return self.layout in ("replicated", "scattered")

    def target(self, engine: str, phase: str = "") -> str:
        """The name of this kind's FFI target on `engine` (`ENGINES`): its one call, or with
        `phase` "start" or "done" its start/done pair's (every pair's done is the
        all-reduce's: `done_target`). The name alone: which targets exist is the extension's
        table (`libra_jax._ffi.target` looks them up)."""
        if engine not in ENGINES or phase not in PHASES:
            raise ValueError(f"no {self.kind} target for engine {engine!r}, phase {phase!r}")
        return f"libra_{self.stem}_{engine}" + (f"_{phase}" if phase else "")

    def role(self, engine: str, phase: str = "") -> str:
        """The target's key in the extension's table (``_libra_ffi.TARGETS``, `_ffi.TARGETS`):
        the engine, then the stem where it is not the all-reduce's, then the phase."""
        self.target(engine, phase)  # checks them
        parts = [engine] + ([] if self.stem == "allreduce" else [self.stem]) + (
            [phase] if phase else [])
        return "_".join(parts)

    @property
    def cpu_role(self) -> str:
        """Its one-call CPU target's role (`role`)."""
        return self.role("cpu")


#: The rows, in the engine's enum order. A ring all-reduce is a reduce-scatter then an
#: all-gather: twice their steps and bytes. The engine's all-reduce reads the n inputs and
#: writes n outputs; its reduce-scatter reads n and writes one shard's worth (1/n on each of n
#: ranks), its all-gather reads the n shards once and writes n outputs.
ROWS: tuple[Collective, ...] = (
    Collective("psum", "all-reduce", 0, "replicated", "allreduce",
               Shape(lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n, lambda n: 2.0 * n),
               traffic_key=None, label="", jax_primitives=("psum", "psum_invariant")),
    Collective("psum_scatter", "reduce-scatter", 1, "scattered", "reduce_scatter",
               Shape(lambda n: n - 1, lambda n: (n - 1) / n, lambda n: n + 1.0),
               traffic_key="reduce_scatter_traffic", label="RS",
               jax_primitives=("reduce_scatter",)),
    Collective("all_gather", "all-gather", 2, "gathered", "all_gather",
               Shape(lambda n: n - 1, lambda n: (n - 1) / n, lambda n: n + 1.0),
               traffic_key="all_gather_traffic", label="AG",
               jax_primitives=("all_gather", "all_gather_invariant")),
    # Each rank sends (n-1)/n of its buffer, one segment to each other rank (a ring's n-1
    # steps); the engine reads the n buffers once and writes n: the all-reduce's 2n.
    Collective("all_to_all", "all-to-all", 3, "exchanged", "all_to_all",
               Shape(lambda n: n - 1, lambda n: (n - 1) / n, lambda n: 2.0 * n),
               traffic_key="all_to_all_traffic", label="A2A", jax_primitives=("all_to_all",)),
)
BY_LAX: dict[str, Collective] = {row.lax: row for row in ROWS}
BY_KIND: dict[str, Collective] = {row.kind: row for row in ROWS}
#: The kind every other kind's traffic is measured against (its row has no traffic key): the
#: all-reduce, the data-parallel gradient collective the paper's model prices (`planner.Layer`'s
#: default, the model's fitted terms, the Gantt chart's row).
REFERENCE: Collective = next(row for row in ROWS if row.traffic_key is None)
#: The model's names, in order (`planner.KINDS`).
KINDS: tuple[str, ...] = tuple(row.kind for row in ROWS)


def of_primitive(primitive: Any) -> Collective | None:
    """The kind a primitive binds (JAX's, by its name, or libra's, the row's "primitive"
    form), or None where it binds none of the rows."""
    for row in ROWS:
        if primitive.name in row.jax_primitives or row.forms.get("primitive") is primitive:
            return row
    return None


def row_of(kind: str | Collective) -> Collective:
    """The row of `kind`, given by a name as a user or a file writes it (the model's,
    "all-gather", or `jax.lax`'s, "all_gather"): the boundary where text becomes a row."""
    if isinstance(kind, Collective):
        return kind
    row = BY_KIND.get(kind) or BY_LAX.get(kind)
    if row is None:
        raise ValueError(f"no collective kind {kind!r} (collectives.KINDS: {KINDS})")
    return row


def lax_name(kind: str) -> str:
    """How a user calls the collective the model names `kind` ("all-reduce" -> "psum")."""
    return BY_KIND[kind].lax


def done_target(engine: str) -> str:
    """The done of every start/done pair on `engine`'s platform: the CPU engine's, or on a GPU
    (the P2P kernels' and NCCL's alike) XLA's stream waiting for libra's."""
    return BY_KIND["all-reduce"].target("cpu" if engine == "cpu" else "cuda", "done")

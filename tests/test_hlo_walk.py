"""The one walk of a compiled program's call graph (t5scale/analysis/hlo_walk.py) under both the
collective count (hlo.collective_ops) and the kernel inventory (kernels.program): nested
loops multiply alike in both, and a `while` condition runs as XLA runs it."""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from t5scale.analysis.hlo import collective_ops
from t5scale.analysis.hlo_module import Instruction, parse_module
from t5scale.analysis.hlo_walk import Walk, trip_count
from t5scale.analysis.kernels import read_program
from t5scale.startup import cuda_plugin_installed, libtpu_installed

OUTER, INNER = 3, 4  # trip counts: a scan with a fori_loop inside
CONTROL = ("while", "call", "conditional", "async-start")


def nested_loops(devices: list, compiler_options: dict | None = None) -> str:
    """HLO of a scan of OUTER steps, each a fori_loop of INNER steps whose body all-gathers and
    all-reduces over `zero` (4 of the 8 devices), under shard_map."""
    mesh = jax.sharding.Mesh(
        np.array(devices).reshape(4, 2), ("zero", "tensor"), axis_types=(AxisType.Explicit,) * 2
    )

    def steps(x):  # [OUTER, INNER, 8, 8] per device
        def outer(carry, block):
            def inner(i, c):
                gathered = lax.all_gather(block[i], "zero", tiled=True)  # [32, 8]
                return c + lax.psum(gathered[:8] * c, "zero")

            return lax.fori_loop(0, INNER, inner, carry), None

        return lax.scan(outer, jnp.ones((8, 8)), x)[0]

    split = P(None, None, "zero")
    mapped = jax.shard_map(steps, mesh=mesh, in_specs=split, out_specs=P(), check_vma=False)
    shape = (OUTER, INNER, 32, 8)
    argument = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, split))
    return jax.jit(mapped).lower(argument).compile(compiler_options=compiler_options).as_text()


def callee(instruction: Instruction, role: str) -> str:
    return re.search(rf"\b{role}=%?([\w.\-]+)", instruction.attributes).group(1)


def runs_per_kind(ops) -> dict[str, int]:
    totals: Counter[str] = Counter()
    for op in ops:
        totals[op.kind] += op.count
    return dict(totals)


def test_nested_loops_multiply_alike_for_collectives_and_kernels():
    text = nested_loops(jax.devices()[:8])
    assert text.count(" all-reduce(") == text.count(" all-gather(") == 1  # written once each
    module = parse_module(text)
    counted, _ = collective_ops(module)
    program = read_program(module)
    scheduled = [collective.op for collective in program.collectives]
    for kind in ("all-reduce", "all-gather"):
        (op,) = [op for op in counted if op.kind == kind]
        assert [op] == [other for other in scheduled if other.kind == kind]
        assert op.count == OUTER * INNER and op.loops == (OUTER, INNER)
        outer_name, inner_name = op.loop_names
        assert inner_name.startswith(outer_name + "/body/")
    # The multiply inside the inner loop is the program's one computing fusion.
    assert [k.runs for k in program.kernels if k.kind == "fusion"] == [OUTER * INNER]

    # The walk with every instruction an item, control flow aside, as the kernel inventory
    # walks: the inner body's run OUTER × INNER times, the outer body's OUTER times, the ENTRY's
    # once, and the conditions' never (a loop of known trip count does not evaluate them).
    (outer_loop,) = [i for i in module.computations[module.entry] if i.opcode == "while"]
    outer_body = callee(outer_loop, "body")
    (inner_loop,) = [i for i in module.computations[outer_body] if i.opcode == "while"]
    assert callee(inner_loop, "body") == counted[0].computation
    expected = {
        module.entry: 1,
        outer_body: OUTER,
        callee(inner_loop, "body"): OUTER * INNER,
        callee(outer_loop, "condition"): 0,
        callee(inner_loop, "condition"): 0,
    }

    def each(instruction: Instruction, computation: str) -> Counter[str] | None:
        return None if instruction.opcode in CONTROL else Counter([instruction.name])

    walk = Walk(module, each)
    runs = walk.per_run(module.entry)
    for computation, times in expected.items():
        for instruction in module.computations[computation]:
            if instruction.opcode not in CONTROL:
                assert runs[instruction.name] == times, (computation, instruction.name)
    assert not walk.unknown_loops


@pytest.mark.skipif(not cuda_plugin_installed(), reason="needs jax's CUDA plugin (test extra)")
def test_nested_loops_compiled_for_gpus_count_alike():
    """XLA:GPU pipelines and unrolls the loops (trip counts of 1, bodies repeated, async
    collectives): the two counts still agree, per kind, on OUTER × INNER."""
    from t5scale.xla_gpu import GpuTopology, compiler_options

    devices = GpuTopology("h100_sxm", 1, 8).devices()
    text = nested_loops(devices, compiler_options(devices))
    module = parse_module(text)
    counted, totals = collective_ops(module)
    program = read_program(module)
    expected = {"all-reduce": OUTER * INNER, "all-gather": OUTER * INNER}
    assert runs_per_kind(counted) == expected
    assert runs_per_kind(c.op for c in program.collectives) == expected
    assert totals.unknown_trip_count_loops == program.unknown_trip_count_loops == 0


# A loop of 3 iterations whose condition holds a collective and a kernel: HLO allows it, though
# JAX's conditions only compare a counter. The old walkers disagreed on it: hlo.py counted the
# condition's collective trips + 1 times, kernels.py not at all.
LOOP = """HloModule m, is_scheduled=true, num_partitions=2

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%fused_negate (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%p)
}

%fused_compare (q: s32[]) -> pred[] {
  %q = s32[] parameter(0)
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%q, %three), direction=LT
}

%body (state: (s32[], f32[8])) -> (s32[], f32[8]) {
  %state = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = f32[8]{0} get-tuple-element(%state), index=1
  %gathered = f32[16]{0} all-gather(%x), channel_id=1, replica_groups={{0,1}}, dimensions={0}
  %negated = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_negate
  ROOT %next = (s32[], f32[8]{0}) tuple(%i, %negated)
}

%condition (state.1: (s32[], f32[8])) -> pred[] {
  %state.1 = (s32[], f32[8]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%state.1), index=0
  %x.1 = f32[8]{0} get-tuple-element(%state.1), index=1
  %summed = f32[8]{0} all-reduce(%x.1), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  ROOT %test = pred[] fusion(%i.1), kind=kLoop, calls=%fused_compare
}

ENTRY %main (x.2: f32[8]) -> f32[8] {
  %x.2 = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %start = (s32[], f32[8]{0}) tuple(%zero, %x.2)
  %loop = (s32[], f32[8]{0}) while(%start), condition=%condition, body=%body, metadata={op_name="jit(step)/while"}, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[8]{0} get-tuple-element(%loop), index=1
}
"""


@pytest.mark.parametrize("known", [True, False], ids=["known_trip_count", "unknown"])
def test_a_loop_condition_counts_alike_for_collectives_and_kernels(known):
    """Known trip count: the body 3 times, the condition never, in both counts. Unknown: the
    body and the condition once each, in both, and the loop is noted by both."""
    text = LOOP if known else LOOP.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
    module = parse_module(text)
    counted, totals = collective_ops(module)
    program = read_program(module)
    runs = 3 if known else 1
    expected = {"all-gather": runs} if known else {"all-gather": 1, "all-reduce": 1}
    assert runs_per_kind(counted) == runs_per_kind(c.op for c in program.collectives) == expected
    (gather,) = [op for op in counted if op.kind == "all-gather"]
    assert gather.loops == ((3,) if known else ())
    assert gather.loop_names == (("jit(step)/while",) if known else ())
    fusions = Counter({k.bytes_written: k.runs for k in program.kernels if k.kind == "fusion"})
    assert fusions == (Counter({8 * 4: 3}) if known else Counter({8 * 4: 1, 1: 1}))
    assert totals.unknown_trip_count_loops == program.unknown_trip_count_loops == int(not known)


def test_xla_never_evaluates_the_condition_of_a_loop_of_known_trip_count():
    """The rule the walk follows, seen on XLA:CPU: a callback in the condition of a loop whose
    trip count XLA knows never runs; in a loop whose trip count XLA cannot know, it runs once
    per iteration and once more."""
    evaluated = []

    def condition(state):
        jax.debug.callback(lambda: evaluated.append(1))
        return state[0] < 5

    def body(state):
        return state[0] + 1, state[1] * 2.0

    def trips(compiled) -> int | None:
        module = parse_module(compiled.as_text())
        (loop,) = [i for body in module.computations.values() for i in body if i.opcode == "while"]
        return trip_count(loop)

    counted = jax.jit(lambda x: lax.while_loop(condition, body, (0, x))).lower(1.0).compile()
    assert trips(counted) == 5
    assert float(counted(1.0)[1]) == 32.0
    jax.effects_barrier()
    assert evaluated == []

    until = lambda s: condition(s) & (s[1] < 20.0)  # noqa: E731
    uncounted = jax.jit(lambda x: lax.while_loop(until, body, (0, x))).lower(1.0).compile()
    assert trips(uncounted) is None
    assert float(uncounted(1.0)[1]) == 32.0  # 5 iterations: 1 → 32
    jax.effects_barrier()
    assert len(evaluated) == 5 + 1


@pytest.mark.skipif(not libtpu_installed(), reason="libtpu: the tpu extra (Linux)")
def test_loops_xla_tpu_leaves_without_a_trip_count_are_counted_from_the_loop():
    """XLA:TPU writes no known_trip_count; each loop counts from a constant to a constant by 1,
    and the walk reads that: the nested loops' collectives run OUTER × INNER times."""
    from t5scale.xla_tpu import TpuSlice, TpuTopology

    program = nested_loops(TpuTopology(TpuSlice.named("v5e-8")).devices())
    module = parse_module(program)
    loops = [i for body in module.computations.values() for i in body if i.opcode == "while"]
    assert [trip_count(loop) for loop in loops] == [None, None]
    assert sorted(trip_count(loop, module) for loop in loops) == [OUTER, INNER]
    ops, totals = collective_ops(module)
    assert runs_per_kind(ops) == {"all-gather": OUTER * INNER, "all-reduce": OUTER * INNER}
    assert totals.unknown_trip_count_loops == 0

"""The kernels of a program XLA compiled for GPUs or TPUs, per executed step, from its scheduled HLO
text (parsed by t5scale/analysis/hlo_module.py). An operation that runs on a TPU is a "kernel" here
too.

- kernels are the instructions of the ENTRY computation and of the computations it runs (`while`
  bodies, `call`, `conditional` branches, `async-start` wrappers), never those inside a fusion: a
  fusion is one kernel. Parameters, tuples, get-tuple-element, bitcasts, constants and the control
  instructions themselves launch nothing;
- loops multiply, as t5scale/analysis/hlo_walk.py walks them: a `while` body runs its known trip
  count per run of its caller and its condition never (XLA's WhileThunk does not evaluate it); a
  loop of unknown trip count has its body and condition counted once, and is noted;
- classes: `gemm` (cuBLAS custom calls, a plain `dot`, a fusion holding a dot; those of 8-bit
  float operands, cuBLASLt's FP8 GEMMs, also counted as `fp8_gemm`), `attention` (cuDNN's
  `__cudnn$fmha…`, and t5scale's Triton kernels `t5_attention_…`:
  t5scale/model/attention_kernels.py; t5scale's output-layer kernel `t5_head_statistics` is a
  `gemm`), `copy` (kernels that move data and compute nothing: copy,
  transpose, slices, dynamic-update-slice, pad, concatenate, and fusions made only of those, index
  arithmetic on scalars aside; so layout changes, cuBLAS's operand padding and the layer scans'
  stacking and unstacking are copies, while a fusion that also converts or adds is a `fusion`),
  `fusion` (every other fusion), `collective` and `other`;
- bytes: what a kernel reads (its operands) and writes (its result), partial accesses at what they
  touch: an operand that a fusion only slices reads the slices, the buffer that a
  dynamic-update-slice updates in place reads nothing and writes the update (the layer scans stack
  every layer's activations so). Libraries' scratch results (cuBLAS's and cuDNN's `s8`/`u8`
  workspaces) are left out;
- FLOPs: a GEMM's 2 × result elements × contracted size; fused attention 2 × B·N·T·S·H per product,
  two products forward and five backward (the four gradient products and the scores recomputed, as
  flash attention runs it); t5scale's kernels two forward, four for dk and dv and three for dq (each
  recomputes the scores), causal ones only up to the diagonal block: a share (n + 1) / 2n of the
  blocks, n the blocks along the grid's first axis;
- collectives: an async `-start`/`-done` pair is one collective, counted at its start, with the
  kernels scheduled between the two in the same computation: those it can hide behind. A pair the
  scheduler left nothing between is marked `is_sync` by XLA and runs on the compute stream, like a
  synchronous collective. XLA keeps both halves in one computation (its collective pipeliner moves
  whole pairs out of loops), so a window never spans two iterations;
- XLA:TPU: a matmul is a `convolution` whose contraction may be a window over a padded spatial
  dimension; an async collective is a fusion whose computation is marked AsyncCollectiveStart, ended
  by one marked AsyncCollectiveDone, with continuation fusions between that compute and carry it
  (kernels; their printed copies of the collective are not counted); a transfer between slices is a
  `send` to the megascale runtime, ended by its `send-done`.

Kernels of equal class, dtype, FLOPs and bytes are one `Kernel` record with the runs of all of them,
so a program's JSON form stays small; collectives likewise.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

from t5scale.analysis.collective_ops import CollectiveOp, format_bytes
from t5scale.analysis.hlo import (
    async_done_types,
    collective_kind,
    collective_op,
    dcn_transfer,
    inside_loop,
    marked_computations,
)
from t5scale.analysis.hlo_module import (
    Instruction,
    Module,
    array_shape,
    custom_call_target,
    dtype_of,
    operand_bytes,
    operand_name,
    operand_type,
    shape_bytes,
    tuple_elements,
    users_of,
)
from t5scale.analysis.hlo_walk import Loop, Walk, fused_body, fused_name, fused_parameter
from t5scale.jsonform import JsonRecord

KERNEL_CLASSES = ("gemm", "attention", "fusion", "copy", "other")
CLASSES = (*KERNEL_CLASSES, "collective")

# Instructions that launch no kernel of their own (control flow runs the computations it calls).
_LAUNCH_NOTHING = frozenset(
    "parameter get-tuple-element tuple bitcast constant after-all add-dependency opt-barrier "
    "domain while call conditional async-start async-update async-done send recv".split()
)
# Instructions that compute nothing, only move data: a fusion of only these, scalars aside, is a
# copy kernel. Not hlo.py's _SAME_ELEMENTS (through which a value stays the same value): these
# include slices, pads and concatenations, which move data but change the elements.
_MOVES_ONLY = frozenset(
    "parameter constant bitcast reshape copy transpose slice dynamic-slice dynamic-update-slice "
    "pad concatenate tuple copy-start".split()
)
_SCRATCH = ("s8", "u8")
_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')
_DOT_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([^}]*)\}")
_SCORES = re.compile(r'"intermediate_tensor_shape"\s*:\s*\{[^{}]*?"dimensions"\s*:\s*\[([^\]]*)\]')
_DIM_LABELS = re.compile(r"dim_labels=([^_]+)_([^-]+)->([\w]+)")  # lhs, kernel, output
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_WINDOW_FIELDS = re.compile(r"(stride|pad|lhs_dilate|rhs_dilate)=([\d_x-]+)")
_IS_SYNC = re.compile(r'"is_sync"\s*:\s*true')
# t5scale's attention kernels (t5scale/model/attention_kernels.py) by the name in their metadata,
# and the products each makes per block pair of scores.
T5_ATTENTION = re.compile(
    r"t5_attention_(forward|backward_dkv|backward_dq|backward_bias)(_causal)?"
)
# t5scale's output-layer kernel (t5scale/model/head_kernel.py): a GEMM with the loss's
# reduction over the vocabulary in its epilogue, priced as the GEMM it replaces
T5_HEAD = re.compile(r"t5_head_statistics")
_T5_ATTENTION_PRODUCTS = {"forward": 2, "backward_dkv": 4, "backward_dq": 3, "backward_bias": 2}
_GRID_X = re.compile(r"\bgrid_x = (\d+)")
_DEVICES = re.compile(r"\b(num_partitions|replica_count)=(\d+)")


@dataclasses.dataclass(frozen=True)
class Kernel(JsonRecord):
    """Kernels of one class, dtype, FLOPs and bytes (each run's), and how often they run per
    step, all of them together."""

    kind: str  # one of KERNEL_CLASSES
    runs: int
    flops: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    dtype: str | None = None  # GEMMs and attention: their operands' element type, e.g. bf16

    @property
    def is_fp8_gemm(self) -> bool:
        """A GEMM of 8-bit float operands (f8e4m3fn, f8e5m2): cuBLASLt's FP8 GEMMs."""
        return self.kind == "gemm" and (self.dtype or "").startswith("f8")


@dataclasses.dataclass(frozen=True)
class ScheduledCollective(JsonRecord):
    """Collectives alike: `op` (its count: runs per step), whether it runs on the compute stream,
    and the kernels scheduled between its start and done: (index into Program.kernels, runs
    per run of the collective)."""

    op: CollectiveOp
    synchronous: bool
    overlapped: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class ClassTotal(JsonRecord):
    """One class's kernels per step: launches, bytes read and written, FLOPs."""

    count: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    flops: float = 0.0

    def plus(self, count: int, read: float, written: float, flops: float) -> ClassTotal:
        return ClassTotal(
            self.count + count,
            self.bytes_read + int(read),
            self.bytes_written + int(written),
            self.flops + flops,
        )


@dataclasses.dataclass(frozen=True)
class KernelInventory(JsonRecord):
    """A step's kernels by class (module docstring), loops multiplied out."""

    gemm: ClassTotal
    attention: ClassTotal
    fusion: ClassTotal
    copy: ClassTotal
    collective: ClassTotal  # bytes: operands read, results written, per device
    other: ClassTotal
    unknown_trip_count_loops: int = 0
    fp8_gemm: ClassTotal = ClassTotal()  # the GEMMs among `gemm` whose operands are 8-bit floats

    @property
    def kernels(self) -> int:
        return sum(getattr(self, kind).count for kind in CLASSES)

    def summary(self) -> str:
        """One line per class: launches, bytes read and written, FLOPs where there are any."""
        lines = []
        for kind in CLASSES:
            total = getattr(self, kind)
            line = (
                f"{kind:<10} {total.count:>7}×  read {format_bytes(total.bytes_read):>10}"
                f"  written {format_bytes(total.bytes_written):>10}"
            )
            lines.append(line + (f"  {total.flops:.4g} FLOP" if total.flops else ""))
        if self.fp8_gemm.count:
            lines.insert(
                1, f"  of which fp8 {self.fp8_gemm.count:>4}×  {self.fp8_gemm.flops:.4g} FLOP"
            )
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Program(JsonRecord):
    """What timing a compiled GPU step needs: its kernels and its collectives, per step."""

    devices: int  # the devices the program spans (partitions × replicas)
    kernels: tuple[Kernel, ...]
    collectives: tuple[ScheduledCollective, ...]
    unknown_trip_count_loops: int = 0

    @property
    def inventory(self) -> KernelInventory:
        totals = dict.fromkeys(KERNEL_CLASSES, ClassTotal())
        fp8_gemm = ClassTotal()
        for kernel in self.kernels:
            runs = kernel.runs
            work = (
                runs,
                runs * kernel.bytes_read,
                runs * kernel.bytes_written,
                runs * kernel.flops,
            )
            totals[kernel.kind] = totals[kernel.kind].plus(*work)
            if kernel.is_fp8_gemm:
                fp8_gemm = fp8_gemm.plus(*work)
        collective = ClassTotal()
        for scheduled in self.collectives:
            op = scheduled.op
            collective = collective.plus(
                op.count, op.count * op.operand_bytes, op.count * op.bytes, 0.0
            )
        return KernelInventory(
            **totals, collective=collective, unknown_trip_count_loops=self.unknown_trip_count_loops,
            fp8_gemm=fp8_gemm,
        )  # fmt: skip


def read_program(module: Module) -> Program:
    """The kernels and collectives of a parsed XLA:GPU or XLA:TPU program (module docstring)."""
    devices = math.prod(int(count) for _, count in _DEVICES.findall(module.header))
    if module.entry is None:
        return Program(devices, (), ())
    reader = _Reader(module)
    runs = reader.kernels.per_run(module.entry)  # first: it numbers the kernels
    kept = [index for index, _ in enumerate(reader.signatures) if runs[index]]
    renumber = {old: new for new, old in enumerate(kept)}
    kernels = tuple(
        dataclasses.replace(reader.signatures[index], runs=runs[index]) for index in kept
    )
    collectives = tuple(
        ScheduledCollective(
            dataclasses.replace(collective.op, count=count),
            collective.synchronous,
            tuple((renumber[index], n) for index, n in collective.overlapped),
        )
        for collective, count in reader.schedule.per_run(module.entry).items()
        if count
    )
    unknown_loops = reader.kernels.unknown_loops | reader.schedule.unknown_loops
    return Program(devices, kernels, collectives, len(unknown_loops))


def instruction_kernels(module: Module) -> dict[str, Kernel]:
    """The kernel each instruction launches (its runs left at 0), by the instruction's name,
    outside fused computations: how a profile, which names each kernel by its HLO op, joins
    this inventory's classes (t5scale/analysis/device_profile.py)."""
    reader = _Reader(module)
    fused = {fused_name(i) for body in module.computations.values() for i in body
             if i.opcode in ("fusion", "fusion-start")}  # fmt: skip
    found = {}
    for name, body in module.computations.items():
        if name in fused:
            continue
        for instruction in body:
            if (index := reader.kernel(instruction)) is not None:
                found[instruction.name] = reader.signatures[index]
    return found


def _scalar(type_text: str) -> bool:
    shape = array_shape(type_text)
    return shape is not None and not shape[1]


def _numbers(listed: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", listed)]


class _Reader:
    """Reads kernels and collectives instruction by instruction; two walks of the call graph
    count them per step: `kernels` (kernel indices) and `schedule` (collectives)."""

    def __init__(self, module: Module):
        self.module = module
        self.done_types = async_done_types(module)
        self.signatures: list[Kernel] = []  # runs=0; the index is the kernel's identity
        self.index: dict[Kernel, int] = {}
        self._kernel_of: dict[str, int | None] = {}  # by instruction name (unique in a module)
        self.kernels = Walk(module, self.launched)
        self.schedule = Walk(module, self.scheduled, _inside_loop)
        self._position = {
            instruction.name: position
            for body in module.computations.values()
            for position, instruction in enumerate(body)
        }
        self._done_at = {
            operand_name(instruction.operands[0]): self._position[instruction.name]
            for body in module.computations.values()
            for instruction in body
            if instruction.opcode.endswith("-done") and instruction.operands
        }
        # XLA:TPU's async collectives: fusions that start and end them (module docstring)
        self._tpu_starts = marked_computations(module, "AsyncCollectiveStart")
        self._done_at |= self._tpu_done_at(marked_computations(module, "AsyncCollectiveDone"))

    def _tpu_done_at(self, dones: set[str]) -> dict[str, int]:
        """{a start fusion's name: the position of its done fusion}: back from each done through
        its operands (tuple elements, moves, the continuation fusions between) to the start."""
        by_name, found = self.module.by_name, {}
        for body in self.module.computations.values():
            for done in (i for i in body if i.opcode == "fusion" and fused_name(i) in dones):
                seen, stack = set(), list(done.operands)
                while stack:
                    name = operand_name(stack.pop())
                    value = by_name.get(name)
                    if name in seen or value is None:
                        continue
                    seen.add(name)
                    if value.opcode == "fusion" and fused_name(value) in self._tpu_starts:
                        found[name] = self._position[done.name]
                        break
                    if value.opcode in ("get-tuple-element", "bitcast", "copy", "fusion"):
                        stack.extend(value.operands)
        return found

    # -- one instruction ------------------------------------------------------------------

    def type_of(self, operand: str) -> str:
        return operand_type(operand, self.module.types)

    def launched(self, instruction: Instruction, computation: str) -> Counter[int] | None:
        """The kernel an instruction launches; None if it launches none (the walk then counts
        the kernels of the computations it runs)."""
        index = self.kernel(instruction)
        return None if index is None else Counter({index: 1})

    def scheduled(
        self, instruction: Instruction, computation: str
    ) -> Counter[ScheduledCollective] | None:
        """The collective an instruction is, with the kernels scheduled between its start and
        done; nothing for a kernel (the walk does not look inside one); None for the rest (the
        walk then counts the collectives of the computations it runs)."""
        if instruction.opcode == "send":  # XLA:TPU's transfer between slices, to send-done
            transfer = dcn_transfer(instruction, computation) or Counter()
            between = self.between(instruction, computation)
            return Counter(
                {ScheduledCollective(op, False, between): n for op, n in transfer.items()}
            )
        if instruction.opcode == "fusion" and fused_name(instruction) in self._tpu_starts:
            return self._tpu_async(instruction, computation)
        op = collective_op(instruction, computation, self.module, self.done_types)
        if op is None:
            return None if self.kernel(instruction) is None else Counter()
        synchronous = not instruction.opcode.endswith("-start") or bool(
            _IS_SYNC.search(instruction.attributes)
        )
        between = self.between(instruction, computation)
        return Counter({ScheduledCollective(op, synchronous, between): 1})

    def _tpu_async(self, start: Instruction, computation: str) -> Counter[ScheduledCollective]:
        """The collective an XLA:TPU start fusion holds, with the kernels up to its done."""
        callee = fused_name(start)
        inner = [i for i in self.module.computations[callee] if collective_kind(i.opcode)]
        ops = [collective_op(i, computation, self.module, self.done_types) for i in inner]
        between = self.between(start, computation)
        return Counter({ScheduledCollective(op, False, between): 1 for op in ops if op})

    def between(self, start: Instruction, computation: str) -> tuple[tuple[int, int], ...]:
        """(kernel index, runs) of the kernels scheduled between an async collective's start
        and its done, which XLA keeps in one computation."""
        first = self._position[start.name] + 1
        done = self._done_at.get(start.name, first)
        launched: Counter[int] = Counter()
        for instruction in self.module.computations[computation][first:done]:
            launched.update(self.kernels.of_instruction(instruction, computation))
        return tuple(sorted(launched.items()))

    def kernel(self, instruction: Instruction) -> int | None:
        if instruction.name not in self._kernel_of:
            self._kernel_of[instruction.name] = self._new_kernel(instruction)
        return self._kernel_of[instruction.name]

    def _new_kernel(self, instruction: Instruction) -> int | None:
        opcode = instruction.opcode
        if opcode in _LAUNCH_NOTHING or opcode.endswith("-done") or collective_kind(opcode):
            return None
        signature = self.signature(instruction)
        if signature not in self.index:
            self.index[signature] = len(self.signatures)
            self.signatures.append(signature)
        return self.index[signature]

    def signature(self, instruction: Instruction) -> Kernel:
        """The kernel an instruction launches (module docstring), its runs left at 0."""
        opcode, attributes = instruction.opcode, instruction.attributes
        result = instruction.result_type
        read = operand_bytes(instruction.operands, self.module.types)
        written = shape_bytes(result)
        first = self.type_of(instruction.operands[0]) if instruction.operands else ""
        if opcode == "custom-call":
            return self._custom_call(instruction, first, read)
        if opcode == "dot":
            flops = _gemm_flops(first, result, _DOT_CONTRACTING.search(attributes))
            return Kernel("gemm", 0, flops, read, written, dtype_of(first))
        if opcode == "convolution":  # XLA:TPU writes its matmuls so
            keys = self.type_of(instruction.operands[1])
            flops = _convolution_flops(first, keys, result, attributes)
            return Kernel("gemm", 0, flops, read, written, dtype_of(first))
        # A fusion XLA:GPU runs asynchronously on the card (fusion-start, then fusion-done):
        # the same kernel, whose start's result repeats its operands (a scan's whole stack for a
        # slice of it), so its bytes are read from the fused computation as a fusion's are.
        if opcode in ("fusion", "fusion-start"):
            body = fused_body(instruction, self.module)
            read, written = self.fusion_bytes(instruction, body)
            if dots := [inner for inner in body if inner.opcode in ("dot", "convolution")]:
                flops = sum(self.signature(dot).flops for dot in dots)
                return Kernel("gemm", 0, flops, read, written, self.signature(dots[0]).dtype)
            # Scalars inside are index arithmetic; a scalar result is a computed value.
            moves_only = (
                bool(body)
                and not _scalar(result)
                and all(inner.opcode in _MOVES_ONLY or _scalar(inner.result_type) for inner in body)
            )
            return Kernel("copy" if moves_only else "fusion", 0, 0.0, read, written)
        if opcode == "dynamic-update-slice":  # in place: the update is read and written
            update = shape_bytes(self.type_of(instruction.operands[1]))
            return Kernel("copy", 0, 0.0, update, update)
        if opcode in ("slice", "dynamic-slice"):
            return Kernel("copy", 0, 0.0, written, written)
        if opcode == "copy-start":  # (destination, source, context): the source is copied
            return Kernel("copy", 0, 0.0, read, read)
        if opcode in _MOVES_ONLY:
            return Kernel("copy", 0, 0.0, read, written)
        return Kernel("other", 0, 0.0, read, written)

    def _custom_call(self, instruction: Instruction, first: str, read: int) -> Kernel:
        """A library's or a Pallas kernel's custom call (module docstring's classes)."""
        attributes, result = instruction.attributes, instruction.result_type
        target = custom_call_target(instruction)
        outputs = tuple_elements(result)
        if target.startswith("__cublas"):
            flops = _gemm_flops(first, outputs[0], _CONTRACTING.search(attributes))
            return Kernel("gemm", 0, flops, read, shape_bytes(outputs[0]), dtype_of(first))
        written = sum(shape_bytes(o) for o in outputs if dtype_of(o) not in _SCRATCH)
        if "fmha" in target:
            flops = _attention_flops(first, attributes, "Backward" in target)
            return Kernel("attention", 0, flops, read, written, dtype_of(first))
        if "triton" in target and (named := T5_ATTENTION.search(attributes)):
            keys = self.type_of(instruction.operands[1])
            flops = _t5_attention_flops(named, first, keys, _GRID_X.search(attributes))
            return Kernel("attention", 0, flops, read, written, dtype_of(first))
        if "triton" in target and T5_HEAD.search(attributes):
            flops = _t5_head_flops(first, self.type_of(instruction.operands[1]))
            return Kernel("gemm", 0, flops, read, written, dtype_of(first))
        if target == "tpu_custom_call" and (named := T5_ATTENTION.search(instruction.name)):
            keys = self.type_of(instruction.operands[1])
            flops = _t5_attention_flops_tpu(named, first, keys)
            return Kernel("attention", 0, flops, read, written, dtype_of(first))
        return Kernel("other", 0, 0.0, read, written)

    def fusion_bytes(self, fusion: Instruction, body: Sequence[Instruction]) -> tuple[int, int]:
        """Bytes a fusion reads and writes, partial reads and in-place updates as such (also
        through the fusions XLA:TPU nests inside one, which slice a layer of a stack)."""
        read = 0
        for position, operand in enumerate(fusion.operands):
            full = shape_bytes(self.type_of(operand))
            part = _touched(body, position, self.module)
            read += full if part is None else min(full, part)
        if not body:
            return read, shape_bytes(fusion.result_type)
        local = {inner.name: inner for inner in body}
        root = body[-1]
        outputs = (
            [local.get(operand_name(o)) for o in root.operands]
            if root.opcode == "tuple"
            else [root]
        )
        written = 0
        for output in outputs:
            while output is not None and output.opcode == "bitcast":
                output = local.get(operand_name(output.operands[0]))
            if output is None:
                continue
            if output.opcode == "dynamic-update-slice":
                written += shape_bytes(self.type_of(output.operands[1]))
            else:
                written += shape_bytes(output.result_type)
        return read, written


def _touched(
    body: Sequence[Instruction], position: int, module: Module, depth: int = 0
) -> int | None:
    """Bytes a fused computation reads of its parameter `position` where it only slices it or
    updates it in place (through bitcasts and nested fusions); None: all of it."""
    parameter = fused_parameter(body, position)
    if parameter is None:
        return None
    users = users_of(body)

    def touched(name: str) -> int | None:
        total = 0
        for user, at in users.get(name, []):
            if user.opcode == "bitcast" and (through := touched(user.name)) is not None:
                total += through
            elif user.opcode in ("slice", "dynamic-slice") and at == 0:
                total += shape_bytes(user.result_type)
            elif (
                user.opcode == "fusion"
                and depth < 4
                and (nested := _touched(fused_body(user, module), at, module, depth + 1))
                is not None
            ):
                total += nested
            elif not (user.opcode == "dynamic-update-slice" and at == 0):
                return None
        return total

    return touched(parameter.name)


def _inside_loop(collective: ScheduledCollective, loop: Loop) -> ScheduledCollective:
    return dataclasses.replace(collective, op=inside_loop(collective.op, loop))


def _convolution_flops(lhs: str, rhs: str, out: str, attributes: str) -> float:
    """2 × the output's batch and features × the (output position, window position) pairs that land
    on the input (padding and dilation as the window says) × the kernel's input features per group.
    """
    shapes = array_shape(lhs), array_shape(rhs), array_shape(out)
    labels = _DIM_LABELS.search(attributes)
    if not (all(shapes) and labels):
        return 0.0
    (_, lhs_dims), (_, rhs_dims), (_, out_dims) = shapes
    lhs_labels, rhs_labels, out_labels = labels.groups()
    spatial = sorted(label for label in out_labels if label.isdigit())
    found = _WINDOW.search(attributes)
    window = {key: [_window_numbers(v) for v in value.split("x")]
              for key, value in _WINDOW_FIELDS.findall(found.group(1) if found else "")}  # fmt: skip
    pairs = 1
    for n, label in enumerate(spatial):
        size = rhs_dims[rhs_labels.index(label)]
        inputs = lhs_dims[lhs_labels.index(label)]
        outputs = out_dims[out_labels.index(label)]
        stride = window.get("stride", [[1]] * len(spatial))[n][0]
        low = window.get("pad", [[0, 0]] * len(spatial))[n][0]
        lhs_dilate = window.get("lhs_dilate", [[1]] * len(spatial))[n][0]
        rhs_dilate = window.get("rhs_dilate", [[1]] * len(spatial))[n][0]
        at = np.arange(outputs)[:, None] * stride + np.arange(size)[None, :] * rhs_dilate - low
        pairs *= int(np.sum((at >= 0) & (at <= (inputs - 1) * lhs_dilate) & (at % lhs_dilate == 0)))
    batch, features = out_dims[out_labels.index("b")], out_dims[out_labels.index("f")]
    return 2.0 * batch * features * pairs * rhs_dims[rhs_labels.index("i")]


def _window_numbers(value: str) -> list[int]:
    return [int(n) for n in value.split("_")]


def _gemm_flops(lhs: str, out: str, contracting: re.Match | None) -> float:
    """2 × result elements × the product of the left operand's contracted dimensions."""
    lhs_shape, out_shape = array_shape(lhs), array_shape(out)
    if not (lhs_shape and out_shape and contracting):
        return 0.0
    contracted = math.prod(lhs_shape[1][d] for d in _numbers(contracting.group(1)))
    return 2.0 * math.prod(out_shape[1]) * contracted


def _t5_head_flops(tokens: str, projection: str) -> float:
    """2·T·D·V of the logits x [T, D] · w [D, V] the head's kernel multiplies."""
    x_shape, w_shape = array_shape(tokens), array_shape(projection)
    if not (x_shape and w_shape) or len(x_shape[1]) != 2 or len(w_shape[1]) != 2:
        return 0.0
    return 2.0 * math.prod(x_shape[1]) * w_shape[1][1]


def _t5_attention_flops(named: re.Match, query: str, keys: str, grid_x: re.Match | None) -> float:
    """Module docstring's FLOPs from q [B, T, N, H] and k [B, S, N, H]; n is the query blocks
    forward and for dq, key blocks for dk and dv."""
    q_shape, k_shape = array_shape(query), array_shape(keys)
    if not (q_shape and k_shape) or len(q_shape[1]) != 4:
        return 0.0
    (batch, q_len, heads, dim), k_len = q_shape[1], k_shape[1][1]
    flops = 2.0 * batch * heads * q_len * k_len * dim * _T5_ATTENTION_PRODUCTS[named.group(1)]
    if named.group(2) and grid_x:
        blocks = int(grid_x.group(1))
        flops *= (blocks + 1) / (2 * blocks)
    return flops


def _t5_attention_flops_tpu(named: re.Match, query: str, keys: str) -> float:
    """As `_t5_attention_flops`, from q [B, N, T, H] and k [B, N, S, H] at their padded lengths
    (what model/attention_tpu.py's kernels run); n is the blocks of 128 along T."""
    q_shape, k_shape = array_shape(query), array_shape(keys)
    if not (q_shape and k_shape) or len(q_shape[1]) != 4:
        return 0.0
    (batch, heads, q_len, dim), k_len = q_shape[1], k_shape[1][2]
    flops = 2.0 * batch * heads * q_len * k_len * dim * _T5_ATTENTION_PRODUCTS[named.group(1)]
    if named.group(2):
        blocks = max(1, q_len // 128)
        flops *= (blocks + 1) / (2 * blocks)
    return flops


def _attention_flops(query: str, attributes: str, backward: bool) -> float:
    """The scores' B·N·T·S from cuDNN's backend config, H the query's last dimension."""
    scores, shape = _SCORES.search(attributes), array_shape(query)
    if not (scores and shape):
        return 0.0
    per_product = 2.0 * math.prod(_numbers(scores.group(1))) * shape[1][-1]
    return per_product * (5 if backward else 2)

"""The instructions that took the most device time in a profiled step, each with what the HLO
says it is: for a reader asking what "the rest of the step" (neither GEMM nor attention) is."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Collection

from t5scale.analysis.device_profile import Trace, name_class, program_kernels
from t5scale.analysis.hlo_module import Instruction, Module
from t5scale.analysis.hlo_walk import fused_body

_OP_NAME = re.compile(r'op_name="([^"]*)"')
_KIND = re.compile(r"kind=(k\w+)")
_PLUMBING = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "broadcast"}
# op_name's parts that say where in the program, not what: JAX's wrappers and the layer scan
_NOISE = re.compile(r"jit\(step\)/|while/body/|eval_jaxpr/|checkpoint/|remat\w*/|closed_call/")


@dataclasses.dataclass(frozen=True)
class TopOp:
    """One instruction's kernels in a profiled step: per step, and what it is."""

    instruction: str  # its name, or the kernel's where no instruction was found
    kind: str  # its class (device_profile.CLASSES)
    seconds: float  # per step
    launches: float  # per step
    summary: str  # the fusion's kind and ops, or the opcode; its result
    op_name: str  # JAX's op_name, the program's scopes trimmed


def top_ops(
    trace: Trace, module: Module, steps: int, leave_out: Collection[str] = (), n: int = 15
) -> list[TopOp]:
    """The `n` instructions with the most kernel time per step, classes `leave_out` left out."""
    kernels, classes = program_kernels(trace, module)
    micros, launches, kinds = Counter(), Counter(), {}
    for event in kernels:
        key = event.hlo_op if event.hlo_op in module.by_name else event.name
        kinds[key] = classes.get(key) or name_class(event.name)
        micros[key] += event.duration_us
        launches[key] += 1
    chosen = [key for key, _ in micros.most_common() if kinds[key] not in leave_out][:n]
    return [
        TopOp(key, kinds[key], micros[key] * 1e-6 / steps, launches[key] / steps,
              *_described(module.by_name.get(key), module))
        for key in chosen
    ]  # fmt: skip


def _described(instruction: Instruction | None, module: Module) -> tuple[str, str]:
    if instruction is None:
        return "no instruction (a kernel of its own)", ""
    body = fused_body(instruction, module)
    if body:
        ops = Counter(i.opcode for i in body if i.opcode not in _PLUMBING)
        kind = _KIND.search(instruction.attributes)
        inner = ", ".join(f"{op}×{k}" if k > 1 else op for op, k in ops.most_common(6))
        what = f"{kind.group(1) if kind else 'fusion'} ({inner}; root {body[-1].opcode})"
    else:
        what = instruction.opcode
    named = _OP_NAME.search(instruction.attributes) or next(
        (found for i in reversed(body) if (found := _OP_NAME.search(i.attributes))), None
    )
    op_name = _NOISE.sub("", named.group(1)) if named else ""
    return f"{what} → {_short(instruction.result_type)}", op_name


def _short(result_type: str) -> str:
    """A result type without its layouts."""
    return re.sub(r"\{[^}]*\}", "", result_type)

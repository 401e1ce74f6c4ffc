"""Write-after-read races inside one program, found in a compiled kernel's TTGIR.

Triton lays every tensor of a program out over its threads, and two memory operations on the same addresses may get
different layouts (the coalescing pass picks one per operation from its pointer's contiguity). A store whose value
is computed from a load of the same addresses is safe whatever the layouts: the value reaches the storing thread
through a layout conversion, which passes through shared memory behind a barrier, so every load has completed. A
store whose value does not depend on that load (zeros written over a gradient just read, say) is ordered after it by
nothing: one warp's store can reach memory before another warp's load of the same element, which then reads the new
value. The result depends on how the warps happen to be scheduled, so a step that should repeat to the bit does not
(kernels/muon.py's normalise pass did this to g until its zeroing moved to the update pass; k_adamw zeroes g after
a barrier).

    hazards(ttgir) -> one line per (load, store) pair of one kernel argument in different layouts where the stored
                      value and mask depend on no load of that argument and no barrier (tl.debug_barrier) lies
                      between them

The scan follows each load's and store's pointer back through its defining operations (addptr, splat, broadcast,
layout conversions, ...) to the kernel's pointer argument, and each stored value's and mask's operands back to the
loads they come from. Operands it cannot follow (loop-carried values) are taken as depending on everything, so a
finding is a real unordered pair; a pair of equal layouts is not reported (one thread owns an element in both).
targets.py runs it on every kernel binary it compiles; tests/kernels/test_targets.py asserts it finds nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DEF = re.compile(r"^\s*(%[\w.#]+)(?::\d+)?(?:\s*,\s*%[\w.#]+)*\s*=\s*(\"?[\w.]+\"?)(.*)$")
_NAME = re.compile(r"%[\w.#]+")
_ARG = re.compile(r"(%[\w.]+):\s")
OPAQUE = "?"  # a value whose origin the scan cannot follow


@dataclass(frozen=True)
class Access:
    op: str  # "load" or "store"
    line: int
    arg: str  # the kernel argument the pointer comes from ("?" when it cannot be followed)
    layout: str
    deps: frozenset[str]  # a store's: the arguments whose loads its value and mask depend on ("?": unknown)


def _layout(line: str) -> str | None:
    """The layout of the tensor type an operation ends with (`tensor<64x64x!tt.ptr<f32>, #blocked1>`: `#blocked1`),
    None for a scalar."""
    ty = line.split(" loc(")[0].rsplit(" : ", 1)[-1].strip()
    if not ty.startswith("tensor<") or ", #" not in ty:
        return None
    return ty[ty.index(", #") + 2 : -1]


def _operands(rest: str) -> list[str]:
    """The SSA names an operation reads: everything before its type (` : `) and its location."""
    body = rest.split(" loc(")[0]
    return _NAME.findall(body.split(" : ")[0])


def hazards(ttgir: str) -> list[str]:
    """Each unordered write-after-read pair in the kernel(s) of `ttgir`, as one line naming the argument, the two
    layouts and the TTGIR lines; [] when there is none."""
    defs: dict[str, tuple[str, list[str]]] = {}
    args: set[str] = set()
    accesses: list[Access] = []
    lines = ttgir.splitlines()
    for line in lines:
        args.update(_ARG.findall(line) if line.lstrip().startswith("tt.func") else ())
        m = _DEF.match(line)
        if m:
            name, op, rest = m.group(1), m.group(2).strip('"'), m.group(3)
            defs[name] = (op, _operands(rest))

    def origin(name: str, seen: frozenset[str] = frozenset()) -> str:
        """The pointer argument `name` is computed from (its first pointer-like operand, followed back)."""
        if name in args:
            return name
        if name not in defs or name in seen:
            return OPAQUE
        op, ops = defs[name]
        if op in ("tt.addptr", "tt.splat", "tt.broadcast", "tt.expand_dims", "ttg.convert_layout", "tt.reshape",
                  "tt.trans", "tt.advance", "tt.make_tensor_ptr") and ops:  # fmt: skip
            return origin(ops[0], seen | {name})
        return OPAQUE

    def loads_under(names: list[str]) -> frozenset[str]:
        """The arguments whose loads the values `names` are computed from (OPAQUE where that cannot be followed)."""
        found: set[str] = set()
        todo, seen = list(names), set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in args:
                continue
            if n not in defs:
                found.add(OPAQUE)  # a block argument: loop-carried, follow no further
                continue
            op, ops = defs[n]
            if op == "tt.load":
                found.add(origin(ops[0]) if ops else OPAQUE)
            todo.extend(ops)
        return frozenset(found)

    for i, line in enumerate(lines, 1):
        lay = _layout(line)
        if lay is None:
            continue  # a scalar access: one address, every thread alike
        m = _DEF.match(line)
        if m and m.group(2) == "tt.load":
            ops = _operands(m.group(3))
            accesses.append(Access("load", i, origin(ops[0]), lay, frozenset()))
        elif line.strip().startswith("tt.store "):
            ops = _operands(line.strip()[len("tt.store") :])
            accesses.append(Access("store", i, origin(ops[0]), lay, loads_under(ops[1:])))
    found = []
    barriers = [i for i, line in enumerate(lines, 1) if line.strip().startswith("gpu.barrier")]
    for st in (a for a in accesses if a.op == "store" and a.arg != OPAQUE):
        if st.arg in st.deps or OPAQUE in st.deps:
            continue
        for ld in (a for a in accesses if a.op == "load" and a.arg == st.arg and a.layout != st.layout):
            if any(ld.line < b < st.line for b in barriers):
                continue  # a barrier between them (tl.debug_barrier): every thread's load is done before the store
            found.append(
                f"{st.arg}: loaded in {ld.layout} (line {ld.line}) and stored in {st.layout} (line {st.line}) "
                "by a value that does not depend on that load: another warp's store may land before this read"
            )
    return found

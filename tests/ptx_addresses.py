"""Read a kernel's PTX for global addresses computed with 32-bit arithmetic.

Sizes and strides reach the kernels as 64-bit integers so that tensors of more than 2^31
elements are addressed correctly. The compiler keeps that only while no 64-bit value on the
way to an address is truncated to 32 bits: an index or stride narrowed to a ``%r`` register
and widened again (``cvt.u32.u64`` ... ``cvt.u64.u32`` or ``mul.wide.s32``), or a
parameter loaded as its low 32 bits (``ld.param.s32``), wraps past 2^31.
:func:`narrowed_addresses` follows every global address (``ld.global``/``st.global``
operands, ``cvta.to.global`` sources, atomics) back through the instructions that define it
and reports each truncation it meets.

One narrowing is exact and allowed: LLVM's division bypass divides in 32 bits only after a
runtime check that both operands fit in 32 bits, in a block of its own holding a
``div``/``rem`` of 32 bits; the 32-bit values that block defines (quotient, remainder) are
not followed further (the truncated operands may be hoisted out of it). Values from the
special registers (``%tid``, ``%ctaid``) are 32 bits by nature and bounded by the grid.
"""
from __future__ import annotations

import re

_REG = re.compile(r"%(?:rd|r)\d+\b")
#: a 64-bit value cut to 32 bits: a conversion, or a parameter (every one is an 8-byte word)
#: loaded as its low half
_TRUNCATE = re.compile(r"^(?:cvt(?:\.\w+)*\.[su]32\.[usb]64|ld\.param\.[sub](?:8|16|32))$")
_DIV32 = re.compile(r"^(?:div|rem)\.[su]32$")
_LABEL = re.compile(r"^\$?[\w$]+:$")
_NO_DEST = ("st.", "bra", "ret", "bar.", "cp.async", "membar", "fence", "red.", "exit",
            "call", "prefetch", "mma.", "ldmatrix", "stmatrix", "wmma.st", "setp.")


def _statements(ptx: str):
    """(block number, opcode, operands) for each instruction of the PTX text."""
    block = 0
    for raw in ptx.splitlines():
        line = raw.split("//", 1)[0].strip()
        if not line:
            continue
        if _LABEL.match(line):
            block += 1
            continue
        for stmt in line.replace("{", ";").replace("}", ";").split(";"):
            stmt = stmt.strip()
            if not stmt or stmt.startswith("."):
                continue
            if stmt.startswith("@"):  # a guard predicate
                stmt = stmt.split(None, 1)[1] if " " in stmt else ""
            parts = stmt.split(None, 1)
            if parts:
                yield block, parts[0], parts[1] if len(parts) > 1 else ""


def narrowed_addresses(ptx: str) -> list[str]:
    """Descriptions of the 32-bit truncations that reach a global address; [] when none."""
    defs: dict[str, list] = {}
    roots = []
    div_blocks = set()
    for block, op, operands in _statements(ptx):
        regs = _REG.findall(operands)
        if _DIV32.match(op):
            div_blocks.add(block)
        if op.startswith(("ld.global", "st.global", "atom.global", "red.global")) \
                or op.startswith("cvta.to.global"):
            # the address: inside the brackets, or cvta's source
            inside = re.findall(r"\[([^\]]*)\]", operands)
            addr = _REG.findall(inside[0]) if inside else regs[1:2]
            roots.extend((op, r) for r in addr)
        if regs and not op.startswith(_NO_DEST) and operands.lstrip().startswith(regs[0]):
            defs.setdefault(regs[0], []).append((block, op, regs[1:]))
    found = []
    for root_op, root in roots:
        seen, todo = set(), [root]
        while todo:
            reg = todo.pop()
            if reg in seen:
                continue
            seen.add(reg)
            for block, op, srcs in defs.get(reg, ()):
                if block in div_blocks and not reg.startswith("%rd"):
                    continue  # the exact 32-bit quotient or remainder of a bypass division
                if _TRUNCATE.match(op):
                    found.append(f"{root_op} address {root} depends on {op} into {reg}")
                if op.startswith(("ld.", "tex.", "atom.")):
                    continue  # a value loaded from memory: not index arithmetic
                todo.extend(srcs)
    return sorted(set(found))

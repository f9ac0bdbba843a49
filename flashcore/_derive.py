"""``d score_mod / d s`` by forward-mode differentiation of the user's Python source.

:func:`value_and_slope` reads a ``score_mod``'s source and writes a twin function that
returns ``(score_mod(s, ...), d score_mod / d s)`` in one pass: each float value that
depends on ``s`` carries its derivative beside it (the chain rule applied statement by
statement, as a forward-mode AD tool does). The kernels' backward needs both per score;
the twin computes them at the cost of about one call of the user's function, where a
finite difference asks for four more (a softcap written as a ``score_mod`` took 1.5x the
built-in softcap's forward+backward on an H100 with the difference). The derivative is
exact but for rounding (float64 on the CPU: float64-accurate end to end).

What it differentiates: assignments (also augmented and to tuples of names from tuples),
``if``/``else`` and ``while`` (the derivative of the path taken), ``for`` over a range that
does not depend on ``s``, ``return``;
``+ - * / ** %`` and ``//``, unary minus, conditional expressions (evaluated lazily, as
written), comparisons (derivative 0), ``abs``/``min``/``max``, casts (``float``,
``float32``...), and from ``math`` and NumPy: ``tanh exp exp2 expm1 log log2 log10 log1p
sqrt sin cos tan sinh cosh atan erf fabs pow``. Anything else that touches ``s``
(a call to another function, indexing by ``s``, ``try``, nested functions), a function
whose source cannot be read (made by ``exec``, in a REPL), or one whose lambda cannot be
told apart on its line, gives None: the backends then fall back to a finite difference
(:data:`flashcore._mods.FD_STEP`). Values that do not depend on ``s`` (indices, ``mod_args``
lookups) are computed exactly as written.

The twin keeps the user's names: its globals are the user's function's globals, and its
closure has the user's closure variables (then the helpers it needs), so the CUDA
backend's float32 twin (float constants and float closure cells as float32, ``math.tanh``
as the approximate instruction at 16 bits) applies to it unchanged.
"""
from __future__ import annotations

import ast
import builtins
import inspect
import math
import textwrap

import numpy as np

from ._memo import Memo

_PREFIX = "__fc_"


class _Unsupported(Exception):
    """A construct the transformation does not differentiate."""


def value_and_slope(fn):
    """A Python function ``(s, *rest) -> (fn(s, *rest), d fn / d s)`` from ``fn``'s source,
    or None where it cannot be written (see the module doc). Once per function."""
    fn = getattr(fn, "py_func", fn)
    return _MADE.get_or_build(fn, _build, fn)


#: value_and_slope(): one twin per user function, bounded like _mods._COMPILED.
_MADE = Memo(256, plans=False)


def _build(fn):
    try:
        node = _function_node(fn)
        return _Writer(fn, node).make()
    except (_Unsupported, OSError, TypeError, SyntaxError, ValueError):
        return None


def _function_node(fn):
    """The ``FunctionDef`` or ``Lambda`` node of ``fn``; where its lines hold several
    candidates, the one whose bytecode is ``fn``'s."""
    code = fn.__code__
    src = textwrap.dedent(inspect.getsource(fn))
    if code.co_name == "<lambda>":
        found = _lambdas(src)
    else:
        found = [n for n in ast.walk(ast.parse(src))
                 if isinstance(n, ast.FunctionDef) and n.name == code.co_name]
    if len(found) > 1:
        found = [n for n in found if _same_code(n, code)]
    if len(found) != 1:
        raise _Unsupported("source not found")
    return found[0]


def _lambdas(src):
    """Each lambda in ``src`` (the lines of the statement that holds it, which need not
    parse alone: ``score_mod=lambda s, b, h, i, j: s,``): the longest text from each
    ``lambda`` on that parses as one lambda expression."""
    if len(src) > 4000:
        raise _Unsupported("source too long")
    found = []
    at = src.find("lambda")
    while at >= 0:
        for end in range(len(src), at, -1):
            try:
                node = ast.parse("(" + src[at:end] + ")", mode="eval").body
            except SyntaxError:
                continue
            if isinstance(node, ast.Lambda):
                found.append(node)
                break
        at = src.find("lambda", at + 6)
    return found


def _same_code(node, code):
    """Whether ``node`` compiles to ``code``'s bytecode (its free variables made free)."""
    free = list(code.co_freevars)
    inner = node if isinstance(node, ast.FunctionDef) else ast.Expr(node)
    outer = _function(
        "_outer", [], [_assign(f, ast.Constant(0.0)) for f in free]
        + [inner, ast.Return(ast.Tuple([_load(f) for f in free], ast.Load()))])
    try:
        made = compile(ast.fix_missing_locations(ast.Module([outer], [])), "<check>", "exec")
    except (SyntaxError, ValueError, TypeError):
        return False
    outer_code = next(c for c in made.co_consts if isinstance(c, type(code)))
    return any(isinstance(c, type(code)) and c.co_name == code.co_name
               and c.co_code == code.co_code for c in outer_code.co_consts)


def _function(name, params, body, vararg=None):
    """A ``def`` node (``type_params`` where this Python has them)."""
    args = ast.arguments(posonlyargs=[], args=[ast.arg(p) for p in params],
                         vararg=ast.arg(vararg) if vararg else None, kwonlyargs=[],
                         kw_defaults=[], kwarg=None, defaults=[])
    extra = {"type_params": []} if "type_params" in ast.FunctionDef._fields else {}
    return ast.FunctionDef(name=name, args=args, body=body, decorator_list=[], returns=None,
                           **extra)


# How each supported function's derivative follows from its argument ``a``, its value ``v``
# and the helpers (``cos``, ``exp``...): an expression in those names.
_RULES = {
    "tanh": "(1.0 - v * v)",
    "exp": "v",
    "exp2": "(v * 0.6931471805599453)",
    "expm1": "(v + 1.0)",
    "log": "(1.0 / a)",
    "log2": "(1.4426950408889634 / a)",
    "log10": "(0.4342944819032518 / a)",
    "log1p": "(1.0 / (1.0 + a))",
    "sqrt": "(0.5 / v)",
    "sin": "cos(a)",
    "cos": "(-sin(a))",
    "tan": "(1.0 + v * v)",
    "sinh": "cosh(a)",
    "cosh": "sinh(a)",
    "atan": "(1.0 / (1.0 + a * a))",
    "erf": "(1.1283791670955126 * exp(-(a * a)))",
}
_HELPERS = {"cos": math.cos, "sin": math.sin, "cosh": math.cosh, "sinh": math.sinh,
            "exp": math.exp, "log": math.log}


def _known_functions():
    """Function object -> kind, for the math and NumPy functions and the builtins handled."""
    kinds = {}
    for name in _RULES:
        for mod in (math, np):
            f = getattr(mod, name, None)
            if f is not None:
                kinds[f] = name
    kinds.update({abs: "abs", math.fabs: "abs", np.abs: "abs", np.absolute: "abs",
                  min: "min", max: "max", np.minimum: "min", np.maximum: "max",
                  math.fmin if hasattr(math, "fmin") else min: "min",
                  math.pow: "pow", np.power: "pow",
                  float: "cast", np.float32: "cast", np.float64: "cast",
                  int: "flat", round: "flat", math.floor: "flat", math.ceil: "flat",
                  math.trunc: "flat", np.floor: "flat", np.ceil: "flat"})
    try:
        import numba

        kinds.update({numba.float32: "cast", numba.float64: "cast"})
    except ImportError:  # pragma: no cover (numba is a dependency)
        pass
    return kinds


class _Writer:
    """Writes the twin of one function (see the module doc)."""

    def __init__(self, fn, node):
        self.fn = fn
        self.node = node
        args = node.args
        if args.posonlyargs or args.kwonlyargs or args.kwarg or not args.args:
            raise _Unsupported("signature")
        self.params = [a.arg for a in args.args]
        self.vararg = args.vararg.arg if args.vararg else None
        self.body = node.body if isinstance(node, ast.FunctionDef) else [ast.Return(node.body)]
        for n in ast.walk(ast.Module(self.body, [])):
            if isinstance(n, ast.Name) and n.id.startswith(_PREFIX):
                raise _Unsupported("reserved name")

            if isinstance(n, (ast.Global, ast.Nonlocal, ast.FunctionDef, ast.Lambda,
                              ast.ClassDef, ast.Try, ast.With, ast.Yield, ast.YieldFrom,
                              ast.Await, ast.NamedExpr, ast.ListComp, ast.GeneratorExp,
                              ast.DictComp, ast.SetComp)):
                raise _Unsupported(type(n).__name__)
        self.closure = dict(zip(fn.__code__.co_freevars,
                                (c.cell_contents for c in fn.__closure__ or ())))
        self.kinds = _known_functions()
        self.n = 0
        self.helpers = {}
        self.active = self._activity()

    # -- which names carry a derivative ------------------------------------------------
    def _activity(self):
        active = {self.params[0]}
        assigns = []
        for n in ast.walk(ast.Module(self.body, [])):
            if isinstance(n, ast.Assign):
                assigns.extend((t, n.value) for t in n.targets)
            elif isinstance(n, (ast.AugAssign, ast.AnnAssign)) and n.value is not None:
                assigns.append((n.target, n.value))
            elif isinstance(n, ast.For):
                assigns.append((n.target, n.iter))
        changed = True
        while changed:
            changed = False
            for target, value in assigns:
                for t, v in self._pairs(target, value):
                    if isinstance(t, ast.Name) and t.id not in active and self._depends(v, active):
                        active.add(t.id)
                        changed = True
        return active

    @staticmethod
    def _pairs(target, value):
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                and len(target.elts) == len(value.elts):
            return list(zip(target.elts, value.elts))
        if isinstance(target, ast.Tuple):
            return [(t, value) for t in target.elts]
        return [(target, value)]

    def _depends(self, e, active=None):
        """Whether the value of ``e`` depends on ``s`` (comparisons and ``not`` do not carry
        a derivative: their value is a bool)."""
        active = self.active if active is None else active
        if isinstance(e, ast.BoolOp) and any(
                not isinstance(x, (ast.Compare, ast.BoolOp, ast.UnaryOp))
                and self._depends(x, active) for x in e.values):
            raise _Unsupported("and/or of values that depend on s")
        if isinstance(e, (ast.Compare, ast.BoolOp)) or (
                isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not)):
            return False
        if isinstance(e, ast.Name):
            return e.id in active
        return any(self._depends(c, active) for c in ast.iter_child_nodes(e))

    # -- writing ---------------------------------------------------------------------------
    def _tmp(self, kind="t"):
        self.n += 1
        return f"{_PREFIX}{kind}{self.n}"

    @staticmethod
    def _d(name):
        return f"{_PREFIX}d_{name}"

    def _helper(self, name, obj):
        key = f"{_PREFIX}h_{name}"
        self.helpers[key] = obj
        return key

    def make(self):
        body = [_assign(self._d(self.params[0]), ast.Constant(1.0))]
        body += self._block(self.body)
        name = getattr(self.fn, "__name__", "score_mod").replace("<", "").replace(">", "")
        twin = _function(name + "_value_and_slope", self.params, body, self.vararg)
        free = list(self.closure) + list(self.helpers)
        outer = _function(f"{_PREFIX}make", free,
                          [twin, ast.Return(ast.Name(twin.name, ast.Load()))])
        mod = ast.fix_missing_locations(ast.Module([outer], []))
        source = ast.unparse(mod)
        env = {}
        exec(compile(source, f"<flashcore d/ds of {name}>", "exec"),  # noqa: S102
             self.fn.__globals__, env)
        made = env[outer.name](*self.closure.values(), *self.helpers.values())
        made.__qualname__ = getattr(self.fn, "__qualname__", name) + "_value_and_slope"
        made.__flashcore_source__ = source
        return made

    def _block(self, stmts):
        out = []
        for st in stmts:
            out.extend(self._stmt(st))
        return out or [ast.Pass()]

    def _stmt(self, st):
        if isinstance(st, ast.Return):
            if st.value is None:
                raise _Unsupported("bare return")
            pre, v, d = self._expr(st.value)
            return pre + [ast.Return(ast.Tuple([v, d or ast.Constant(0.0)], ast.Load()))]
        if isinstance(st, (ast.Assign, ast.AnnAssign)):
            targets = st.targets if isinstance(st, ast.Assign) else [st.target]
            if st.value is None:
                return []
            out = []
            for target in targets:
                out += self._assign(target, st.value)
            return out
        if isinstance(st, ast.AugAssign):
            target = st.target
            if not isinstance(target, ast.Name):
                if self._depends(st.value) or self._depends(target):
                    raise _Unsupported("augmented assignment to an item")
                return [st]
            load = ast.Name(target.id, ast.Load())
            return self._assign(target, ast.BinOp(load, st.op, st.value))
        if isinstance(st, ast.If):
            self._inactive(st.test)
            return [ast.If(st.test, self._block(st.body), self._block(st.orelse)
                           if st.orelse else [])]
        if isinstance(st, ast.For):
            self._inactive(st.iter)
            if self._depends(st.target) or st.orelse:
                raise _Unsupported("loop")
            return [ast.For(st.target, st.iter, self._block(st.body), [])]
        if isinstance(st, ast.While):
            self._inactive(st.test)  # (a comparison: the path taken)
            if st.orelse:
                raise _Unsupported("loop")
            return [ast.While(st.test, self._block(st.body), [])]
        if isinstance(st, (ast.Pass, ast.Break, ast.Continue)):
            return [st]
        if isinstance(st, (ast.Expr, ast.Assert, ast.Raise)):
            for c in ast.iter_child_nodes(st):
                self._inactive(c)
            return [st]
        raise _Unsupported(type(st).__name__)

    def _inactive(self, e):
        if self._depends(e):
            raise _Unsupported("a test or bound that depends on s")

    def _assign(self, target, value):
        if isinstance(target, ast.Name):
            pre, v, d = self._expr(value)
            if target.id not in self.active:
                return pre + [_assign(target.id, v)]
            # the derivative first: both read the name's old value (``x = x * x``)
            return pre + [_assign(self._d(target.id), d or ast.Constant(0.0)),
                          _assign(target.id, v)]
        if isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts):
            if isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts):
                out, tmps = [], []
                for t, e in zip(target.elts, value.elts):  # all values first, as Python does
                    pre, v, d = self._expr(e)
                    tv, td = self._tmp(), self._tmp("d")
                    out += pre + [_assign(tv, v), _assign(td, d or ast.Constant(0.0))]
                    tmps.append((t.id, tv, td))
                for name, tv, td in tmps:
                    out.append(_assign(name, _load(tv)))
                    if name in self.active:
                        out.append(_assign(self._d(name), _load(td)))
                return out
            if not self._depends(value) and not any(t.id in self.active for t in target.elts):
                return [ast.Assign([target], value)]
        if self._depends(value) or self._depends(target):
            raise _Unsupported("assignment")
        return [ast.Assign([target], value)]

    def _expr(self, e):
        """``(statements, value, derivative)`` of expression ``e``: the statements compute
        its parts; the value and derivative are expressions (derivative None: zero)."""
        if not self._depends(e):
            return [], e, None
        if isinstance(e, ast.Name):
            return [], e, _load(self._d(e.id))
        if isinstance(e, ast.UnaryOp):
            pre, v, d = self._expr(e.operand)
            if isinstance(e.op, ast.USub):
                return pre, ast.UnaryOp(ast.USub(), v), ast.UnaryOp(ast.USub(), d)
            if isinstance(e.op, ast.UAdd):
                return pre, v, d
            raise _Unsupported("unary op")
        if isinstance(e, ast.BinOp):
            return self._binop(e)
        if isinstance(e, ast.IfExp):
            return self._ifexp(e)
        if isinstance(e, ast.Call):
            return self._call(e)
        raise _Unsupported(type(e).__name__)

    def _operand(self, e):
        """``(statements, value name, derivative)`` with the value held in a name (it is read
        twice)."""
        pre, v, d = self._expr(e)
        if isinstance(v, (ast.Name, ast.Constant)):
            return pre, v, d
        t = self._tmp()
        return pre + [_assign(t, v)], _load(t), d

    def _binop(self, e):
        op = e.op
        pa, a, da = self._operand(e.left)
        pb, b, db = self._operand(e.right)
        pre = pa + pb
        v = ast.BinOp(a, op, b)
        if isinstance(op, (ast.Add, ast.Sub)):
            if da is None:
                d = db if isinstance(op, ast.Add) else ast.UnaryOp(ast.USub(), db)
            elif db is None:
                d = da
            else:
                d = ast.BinOp(da, op, db)
            return pre, v, d
        if isinstance(op, ast.Mult):
            parts = [ast.BinOp(da, ast.Mult(), b) if da is not None else None,
                     ast.BinOp(a, ast.Mult(), db) if db is not None else None]
            parts = [p for p in parts if p is not None]
            return pre, v, parts[0] if len(parts) == 1 else ast.BinOp(parts[0], ast.Add(),
                                                                      parts[1])
        if isinstance(op, ast.Div):
            if db is None:  # da / b: a division by a constant stays one (the CUDA twin
                return pre, v, ast.BinOp(da, ast.Div(), b)  # makes it a product)
            t = self._tmp()
            pre = pre + [_assign(t, v)]
            num = ast.UnaryOp(ast.USub(), _mul(_load(t), db))  # (da - v db) / b
            if da is not None:
                num = ast.BinOp(num, ast.Add(), da)
            return pre, _load(t), ast.BinOp(num, ast.Div(), b)
        if isinstance(op, ast.Pow):
            return self._power(pre, a, da, b, db)
        if isinstance(op, ast.Mod) and db is None:
            return pre, v, da
        if isinstance(op, ast.FloorDiv):
            return pre, v, None
        raise _Unsupported("operator")

    def _power(self, pre, a, da, b, db):
        t = self._tmp()
        pre = pre + [_assign(t, ast.BinOp(a, ast.Pow(), b))]
        parts = []
        if da is not None:  # b * a ** (b - 1) * da
            parts.append(_mul(_mul(b, ast.BinOp(a, ast.Pow(), ast.BinOp(b, ast.Sub(),
                                                                          ast.Constant(1)))),
                              da))
        if db is not None:  # a ** b * log(a) * db
            log = self._helper("log", math.log)
            parts.append(_mul(_mul(_load(t), ast.Call(_load(log), [a], [])), db))
        d = parts[0] if len(parts) == 1 else ast.BinOp(parts[0], ast.Add(), parts[1])
        return pre, _load(t), d

    def _ifexp(self, e):
        self._inactive(e.test)
        tv, td = self._tmp(), self._tmp("d")
        branches = []
        for side in (e.body, e.orelse):
            pre, v, d = self._expr(side)
            branches.append(pre + [_assign(tv, v), _assign(td, d or ast.Constant(0.0))])
        return [ast.If(e.test, *branches)], _load(tv), _load(td)

    def _callee(self, f):
        """The object a call's function expression names (a global, closure variable,
        builtin, or an attribute of one), or None."""
        if isinstance(f, ast.Name):
            if f.id in self.closure:
                return self.closure[f.id]
            g = self.fn.__globals__
            if f.id in g:
                return g[f.id]
            return getattr(builtins, f.id, None)
        if isinstance(f, ast.Attribute):
            base = self._callee(f.value)
            return getattr(base, f.attr, None) if base is not None else None
        return None

    def _call(self, e):
        if e.keywords or any(isinstance(a, ast.Starred) for a in e.args):
            raise _Unsupported("call")
        try:
            kind = self.kinds.get(self._callee(e.func))
        except TypeError:  # an unhashable object
            kind = None
        if kind is None or not e.args:
            raise _Unsupported("call of a function it does not know")
        if kind in ("min", "max"):
            return self._extreme(e, kind)
        if kind == "pow" and len(e.args) == 2:
            pa, a, da = self._operand(e.args[0])
            pb, b, db = self._operand(e.args[1])
            return self._power(pa + pb, a, da, b, db)
        if len(e.args) != 1:
            raise _Unsupported("call")
        pre, a, da = self._operand(e.args[0])
        if kind == "flat":
            return pre, ast.Call(e.func, [a], []), None
        if kind == "cast":
            return pre, ast.Call(e.func, [a], []), ast.Call(e.func, [da], [])
        if kind == "abs":
            t = self._tmp()
            sign = ast.IfExp(ast.Compare(a, [ast.GtE()], [ast.Constant(0)]), da,
                             ast.UnaryOp(ast.USub(), da))
            return pre + [_assign(t, ast.Call(e.func, [a], []))], _load(t), sign
        t = self._tmp()
        pre = pre + [_assign(t, ast.Call(e.func, [a], []))]
        rule = ast.parse(_RULES[kind], mode="eval").body
        names = {"a": a, "v": _load(t)}
        for n in ast.walk(rule):
            if isinstance(n, ast.Name) and n.id in _HELPERS:
                names[n.id] = _load(self._helper(n.id, _HELPERS[n.id]))
        rule = _Substitute(names).visit(rule)
        return pre, _load(t), _mul(rule, da)

    def _extreme(self, e, kind):
        pre, a, da = self._operand(e.args[0])
        for arg in e.args[1:]:
            pb, b, db = self._operand(arg)
            tv, td = self._tmp(), self._tmp("d")
            keep_a = ast.Compare(a, [ast.LtE() if kind == "min" else ast.GtE()], [b])
            pre = pre + pb + [ast.If(keep_a,
                                     [_assign(tv, a), _assign(td, da or ast.Constant(0.0))],
                                     [_assign(tv, b), _assign(td, db or ast.Constant(0.0))])]
            a, da = _load(tv), _load(td)
        return pre, a, da


class _Substitute(ast.NodeTransformer):
    def __init__(self, names):
        self.names = names

    def visit_Name(self, node):
        return self.names.get(node.id, node)


def _load(name):
    return ast.Name(name, ast.Load())


def _assign(name, value):
    return ast.Assign([ast.Name(name, ast.Store())], value)


def _mul(a, b):
    return ast.BinOp(a, ast.Mult(), b)

"""When a kept trace may serve a new call: the keys compared before reusing one.

A trace is a function of the model object and of everything its code reads besides the
inputs. Three keys say whether that changed:

- :func:`signature`: the inputs' structure, ranks, dtypes, devices and non-tensor
  values;
- :func:`function_key`: an output function's code and the values it reads, compared by
  value (raises :class:`Unkeyed` where one cannot be: then it is traced on every call);
- :func:`stamp`: the model. It never raises: what it cannot compare by value, it
  compares by identity. It holds

  * every submodule (identity, class, mode), its hooks (forward and backward), its
    parameters and buffers (identity, storage, in-place version), and every entry of
    its ``__dict__``: numbers, strings, flags, tensors (identity, storage, version),
    containers (lists, tuples, dicts, sets: by content, up to :data:`CONTAINER` items
    and 4 levels deep), functions (an instance's own ``forward``), and objects (a
    config: its attributes, two levels deep);
  * every class of those modules, up to ``nn.Module``: the functions and plain values
    in its namespace (``nn.Tanh.forward = ...`` is seen);
  * for each function of the model's own code (not torch's, transformers' or the
    standard library's: those by identity): the globals it reads and, for a module or
    class it reads a global of, the attributes its code names (``settings.SCALE``),
    its closure and defaults, and the functions it calls among those, recursively.

What is not compared: objects' state more than two levels below a module attribute
(by identity), containers of more than :data:`CONTAINER` items (by identity and
length), and the installed libraries' module-level state (``torch.nn.functional.gelu``
replaced).
"""

from __future__ import annotations

import builtins
import collections
import dis
import functools
import sys
import types
import weakref

import torch
from torch.utils import _pytree as pytree

#: items of a container compared by content (larger ones: by identity and length)
CONTAINER = 1024
_DEPTH = 4  # containers nested deeper are compared by identity
_OBJECT_DEPTH = 2  # an object's attributes are compared this deep (a config: 1)

_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_AS_IS = frozenset({int, str, type(None)})  # compared as they are (fast)
_CONTAINERS = frozenset({list, tuple, dict, set, frozenset, collections.OrderedDict})
_LIBRARIES = frozenset(
    {"torch", "transformers", "numpy", "scipy", "pandas", "einops", "semiring_backprop",
     "captum", "transformer_lens", "accelerate", "safetensors", "tokenizers", "typing_extensions",
     "jaxtyping", "huggingface_hub", "_pytest", "pytest", "IPython"}
    | set(sys.stdlib_module_names)
)  # fmt: skip
# entries of every nn.Module's __dict__ that do not change what forward computes
_MODULE_SKIP = frozenset(
    {"_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
     "_load_state_dict_post_hooks", "_non_persistent_buffers_set", "__dict__",
     "__weakref__", "__doc__", "__module__", "__qualname__", "__annotations__",
     "__firstlineno__", "__static_attributes__", "_version", "dump_patches",
     "call_super_init", "T_destination"}
)  # fmt: skip


def is_library(obj) -> bool:
    """Code or state of an installed library (torch, transformers, the standard library):
    compared by identity, not read into."""
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    if not isinstance(name, str):
        return False
    return name.partition(".")[0] in _LIBRARIES


@functools.lru_cache(maxsize=4096)
def names_read(code: types.CodeType) -> tuple[frozenset, frozenset]:
    """The global names ``code`` reads, and every name it uses (attribute names among
    them), nested functions and comprehensions included."""
    globs, names = set(), set(code.co_names)
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            globs.add(ins.argval)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            g, n = names_read(c)
            globs |= g
            names |= n
    return frozenset(globs), frozenset(names)


def _namespace(obj) -> dict:
    """The attributes a module or class holds itself (a class: along its MRO)."""
    if isinstance(obj, types.ModuleType):
        return vars(obj)
    out: dict = {}
    for k in reversed(obj.__mro__[:-1]):  # object's own are no user state
        out.update(vars(k))
    return out


# -- the model -------------------------------------------------------------------------


class _Ident:
    """An object compared by identity, held weakly where it can be (a kept stamp must
    not keep the model alive) and strongly otherwise (an id alone could be reused by a
    new object). A referent that died compares unequal: the model changed."""

    __slots__ = ("_ref",)

    def __init__(self, obj):
        try:
            self._ref = weakref.ref(obj)
        except TypeError:
            self._ref = lambda obj=obj: obj

    def __eq__(self, other):
        if not isinstance(other, _Ident):
            return NotImplemented
        obj = self._ref()
        return obj is not None and obj is other._ref()

    __hash__ = None


class _Walk:
    """One walk over a model: each object read into once (a config shared by every
    layer; cycles). Containers are not remembered: their depth bounds them."""

    def __init__(self):
        self.seen: dict = {}  # id of an object read into -> its fingerprint
        self.classes: dict = {}  # class -> fingerprint of its namespace
        self.modules: list = []  # nn.Modules met (submodules, modules in attributes)
        self.module_ids: set = set()

    def module(self, m) -> None:
        if id(m) not in self.module_ids:
            self.module_ids.add(id(m))
            self.modules.append(m)

    def value(self, v, depth: int = 0):
        t = type(v)
        if t in _AS_IS:
            return v
        if t in _CONTAINERS:
            if not v:
                return t
            if depth >= _DEPTH or len(v) > CONTAINER:
                return ("container", _Ident(v), t, len(v))
            d = depth + 1
            if t is dict or isinstance(v, dict):
                return (t, tuple((self.value(k, d), self.value(x, d)) for k, x in v.items()))
            items = sorted(v, key=repr) if isinstance(v, set | frozenset) else v
            return (t, tuple(self.value(x, d) for x in items))
        if isinstance(v, _SCALARS):
            return (t, v)
        if isinstance(v, torch.Tensor):
            return tensor_key(v)
        key = id(v)
        if key in self.seen:
            return ("ref", key)
        self.seen[key] = None  # a cycle reads as a reference
        fp = self._value(v, depth)
        self.seen[key] = fp
        return fp

    def _value(self, v, depth):
        if isinstance(v, torch.nn.Module):
            self.module(v)
            return ("module", _Ident(v))
        if isinstance(v, types.FunctionType):
            return self.function(v)
        if isinstance(v, types.MethodType):
            return ("method", self.value(v.__func__), _Ident(v.__self__))
        if isinstance(v, functools.partial):
            return ("partial", self.value(v.func), self.value(v.args, depth + 1),
                    self.value(v.keywords, depth + 1))  # fmt: skip
        if isinstance(v, staticmethod | classmethod):
            return (type(v), self.value(v.__func__))
        if isinstance(v, property):
            return ("property", self.value(v.fget), self.value(v.fset))
        if isinstance(v, type | types.ModuleType | types.BuiltinFunctionType):
            return ("object", _Ident(v))
        if depth < _OBJECT_DEPTH and isinstance(getattr(v, "__dict__", None), dict):
            return ("object", _Ident(v), self.value(vars(v), depth + 1))
        return ("object", _Ident(v))

    def function(self, fn: types.FunctionType):
        """A function by identity and code; the model's own code also by what it reads."""
        code = fn.__code__
        if is_library(fn):
            return ("function", _Ident(fn))
        cells = tuple(self.value(_cell(c)) for c in fn.__closure__ or ())
        defaults = (self.value(fn.__defaults__), self.value(fn.__kwdefaults__))
        return ("function", _Ident(fn), code, defaults, cells, self.globals_read(fn))

    def globals_read(self, fn) -> tuple:
        globs, names = names_read(fn.__code__)
        g = fn.__globals__
        out = []
        for name in sorted(globs):
            if name not in g:
                out.append((name, "builtin", _Ident(getattr(builtins, name, None))))
                continue
            v = g[name]
            out.append((name, self.value(v)))
            if isinstance(v, types.ModuleType | type) and not is_library(v):
                space = _namespace(v)
                out.append(tuple((a, self.value(space[a])) for a in sorted(names) if a in space))
        return tuple(out)

    def cls(self, c: type):
        if c not in self.classes:
            self.classes[c] = None
            parts = []
            for k in c.__mro__:
                if k is torch.nn.Module or k is object:
                    break
                parts.append((k, tuple((name, self.value(v)) for name, v in vars(k).items()
                                       if name not in _MODULE_SKIP)))  # fmt: skip
            self.classes[c] = tuple(parts)
        return self.classes[c]


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a name assigned later)
        return None


def tensor_key(t: torch.Tensor) -> tuple:
    """A tensor by identity, storage and in-place version (inference tensors have no
    version counter; a fake tensor no storage)."""
    try:
        ptr = t.data_ptr()
    except RuntimeError:
        ptr = None
    version = None if t.is_inference() else t._version
    return ("tensor", _Ident(t), ptr, version)


def stamp(model) -> tuple:
    """What the trace of ``model`` depends on besides the inputs (see the module
    docstring); equal stamps: the same function."""
    walk = _Walk()
    if not isinstance(model, torch.nn.Module):
        return (walk.value(model),)
    for m in model.modules():
        walk.module(m)
    out, i = [], 0
    while i < len(walk.modules):  # modules met in attributes are walked too
        m = walk.modules[i]
        i += 1
        attrs = tuple((k, walk.value(v)) for k, v in m.__dict__.items() if k not in _MODULE_SKIP)
        out.append((_Ident(m), walk.cls(type(m)), attrs))
    out.append(_global_hooks())
    return tuple(out)


def _global_hooks() -> tuple:
    """Hooks registered for every module (``nn.modules.module.register_module_*``)."""
    mod = torch.nn.modules.module
    names = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
             "_global_backward_pre_hooks", "_global_forward_hooks_always_called")  # fmt: skip
    walk = _Walk()
    return tuple(walk.value(dict(getattr(mod, n, {}))) for n in names)


#: elements of every parameter and buffer compared for writes torch's version counter
#: does not see (what prepared weights are checked by)
SAMPLES = 64


def samples(model) -> torch.Tensor:
    """64 evenly spaced elements of every float parameter and buffer, as their bits."""
    if not isinstance(model, torch.nn.Module):
        return torch.zeros(0, dtype=torch.int64)
    groups: dict = {}  # (dtype, device) -> the sampled views (one copy per group)
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point() and t.numel() and t.layout == torch.strided and not t.is_meta:
            flat = t.detach().reshape(-1) if t.is_contiguous() else t.detach().flatten()
            step = max(1, flat.numel() // SAMPLES)
            groups.setdefault((t.dtype, t.device), []).append(flat[::step][:SAMPLES])
    parts = [torch.cat(views).to(torch.float64).cpu() for views in groups.values()]
    return torch.cat(parts).view(torch.int64) if parts else torch.zeros(0, dtype=torch.int64)


# -- the output function ---------------------------------------------------------------


class Unkeyed(Exception):
    """A value an output function reads cannot be compared by value."""


def function_key(fn, depth=0):
    """What decides what ``fn`` computes: its code and the values it reads (closure,
    defaults, the globals its code names and, of a module or class among them that is
    not a library's, the attributes its code names), by value; raises :class:`Unkeyed`
    where one of them cannot be compared by value."""
    if fn is None:
        return None
    if depth > 3:
        raise Unkeyed
    if isinstance(fn, functools.partial):
        return ("partial", function_key(fn.func, depth + 1), _value_key(fn.args, depth),
                _value_key(fn.keywords, depth))  # fmt: skip
    if isinstance(fn, types.BuiltinFunctionType | torch._ops.OpOverloadPacket):
        return ("builtin", fn)
    if callable(getattr(type(fn), "_trace_key", None)):  # a target object, by its value
        return ("object", type(fn), fn._trace_key())
    if not isinstance(fn, types.FunctionType):
        raise Unkeyed  # a callable object or a bound method: its state is not known
    code = fn.__code__
    globs, names = names_read(code)
    glob = []
    for name in sorted(globs):
        if name not in fn.__globals__:
            continue
        v = fn.__globals__[name]
        glob.append((name, _value_key(v, depth)))
        if isinstance(v, types.ModuleType | type) and not is_library(v):
            space = _namespace(v)  # settings.IDX, Knobs.IDX: by value
            glob.append(tuple((a, _value_key(space[a], depth + 1)) for a in sorted(names)
                              if a in space and not a.startswith("__")))  # fmt: skip
    cells = tuple(_value_key(_cell(c), depth) for c in fn.__closure__ or ())
    defaults = (_value_key(fn.__defaults__, depth), _value_key(fn.__kwdefaults__, depth))
    return ("function", code, tuple(glob), cells, defaults)


def _value_key(v, depth):
    if isinstance(v, _SCALARS):
        return (type(v).__name__, v)
    if isinstance(v, tuple | list):
        return (type(v).__name__, tuple(_value_key(x, depth) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((_value_key(k, depth), _value_key(x, depth)) for k, x in v.items()))
    if isinstance(v, torch.Tensor):
        if v.numel() > 64 or v.requires_grad or v.is_meta or v.layout != torch.strided:
            raise Unkeyed
        return ("tensor", v.dtype, v.device, tuple(v.shape), tuple(v.flatten().tolist()))
    if isinstance(v, types.ModuleType | type):
        return ("object", v)  # held by the key: modules and classes live long anyway
    if isinstance(v, staticmethod | classmethod):
        return function_key(v.__func__, depth + 1)
    if isinstance(v, types.FunctionType | functools.partial | types.BuiltinFunctionType):
        return function_key(v, depth + 1)
    raise Unkeyed


# -- the inputs ------------------------------------------------------------------------


def signature(args, kwargs):
    """What every graph traced for these inputs shares: structure, tensor ranks, dtypes
    and devices, and the values of non-tensor arguments (sizes are checked by
    ``Graph.accepts``)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    sig, first = [], {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):  # and which inputs are one tensor (mha(x, x, x))
            sig.append(("T", leaf.dim(), leaf.dtype, leaf.device, first.setdefault(id(leaf), i)))
        else:
            try:
                hash(leaf)
                sig.append(("V", type(leaf).__name__, leaf))
            except TypeError:
                sig.append(("I", id(leaf)))
    return (str(spec), tuple(sig))

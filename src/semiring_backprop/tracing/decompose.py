"""``program.run_decompositions(table)``, with each distinct op traced once.

torch's ``run_decompositions`` traces the whole exported graph again, op by op, through
functionalization, fake tensors and the decomposition table: most of a first call's
time on a transformer, where each layer repeats the ops of the one before. For a graph
of fixed sizes whose ops are all functional, what an op becomes depends only on the op,
its non-tensor arguments and the layout of its tensor arguments (shape, strides, dtype,
device). :func:`decompose` traces each distinct such op once, in one batch, through the
AOT export ``run_decompositions`` itself uses, and copies the result wherever the op
recurs: the nodes, their order and names, the edges, each node's module and value layout
are those ``run_decompositions`` gives (``tests/test_decompose.py`` compares the two on
every model family the tests build). Any other graph (symbolic sizes, in-place ops,
higher-order ops, constants made while decomposing), and any failure on the way, goes
to ``run_decompositions``. What decides that, and the key of an op, is :mod:`.op_keys`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import types

import torch
from torch.export.graph_signature import (
    ExportGraphSignature,
    OutputSpec,
    TensorArgument,
)

from . import ops as _ops  # noqa: F401  (defines the mark op)
from .op_keys import DETACH_, Unsupported, check, input_order, layout, op_key, same_layouts

log = logging.getLogger(__name__)
aten = torch.ops.aten

_mark = torch.ops.semiring_backprop.mark.default
_ROUNDS = 6  # batches of ops traced before the walk (an op missed then is traced alone)
#: meta a retraced node takes from the node it came from (torch.fx.proxy's list)
_COPIED = ("nn_module_stack", "torch_fn", "source_fn_stack", "recompute", "ac_graph_id",
           "has_backward_hook", "custom", "partitioner_tag", "stack_trace")  # fmt: skip


def decompose(program, table: dict):
    """The program ``program.run_decompositions(table)`` gives (see the module's doc)."""
    try:
        return _Decomposer(program, table).run()
    except Unsupported as e:
        log.debug("decomposing the whole graph at once: %s", e)
    except Exception as e:  # noqa: BLE001  (torch's own way says what fails, if it does)
        log.debug("decomposing the whole graph at once after %s: %s", type(e).__name__, e)
    return program.run_decompositions(table)


class _Decomposer:
    def __init__(self, program, table):
        self.program = program
        self.graph = program.graph_module.graph
        check(program)
        try:
            from torch._guards import detect_fake_mode
            from torch.export.exported_program import (
                _split_decomp_table_to_cia_and_python_decomp,
            )
        except ImportError as e:  # another torch: its own run_decompositions
            raise Unsupported(f"torch internals: {e}") from None
        self.cia, self.py_table = _split_decomp_table_to_cia_and_python_decomp(dict(table))
        vals = [n.meta.get("val") for n in self.graph.nodes if n.op == "placeholder"]
        self.fake = detect_fake_mode(vals)
        if self.fake is None:
            raise Unsupported("no fake tensors")
        self.templates: dict = {}
        self.detached: dict = {}  # placeholder -> its value, detached
        self.inputs: dict = {}  # placeholder -> its value without a constant's value
        self.likes: dict = {}  # layout -> a fake tensor of it (marks' values, planning)
        self.guesses: dict = {}  # key -> what the op gives run on fake tensors (planning)
        self.keys: dict = {}  # node -> its key, as the last planning round found it
        self.settled = False  # the keys of that round are those of the new graph

    def run(self):
        try:
            from torch.export.exported_program import _override_composite_implicit_decomp
        except ImportError as e:
            raise Unsupported(f"torch internals: {e}") from None
        # as run_decompositions: no fake mode of the caller's; the table's own kernels for
        # the composite ops it names (installed once: installing them takes a while)
        with _no_fake_mode(), _override_composite_implicit_decomp(self.cia):
            self._plan()
            new = torch.fx.Graph()
            env: dict = {}
            specs = input_order(self.program)
            placeholders = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
            for spec in specs:  # (in the order run_decompositions gives them)
                node = placeholders[spec.arg.name]
                env[node] = self._emit(new, node, env)
            for node in self.graph.nodes:
                if node.op != "placeholder":
                    env[node] = self._emit(new, node, env)
            new.eliminate_dead_code()
        return self._program(new, env, specs)

    # -- templates ---------------------------------------------------------------------

    def _plan(self) -> None:
        """Trace the distinct ops in a few batches: first with the layouts of the graph
        as exported, then with those the decomposed graph gives, until they agree (at
        once where each guess had its template's layouts: the keys then stand)."""
        for _ in range(_ROUNDS):
            items = self._distinct()
            if not items:
                return
            self._trace_batch(items)
            if all(same_layouts(self.guesses[k], self.templates[k][3]) for k in items):
                self.settled = True
                return

    def _distinct(self) -> dict:
        """``{key: (node, {input: value})}`` for one node of each distinct op not traced
        yet, with the values the decomposed graph gives as far as the ops traced so far
        tell (their templates' outputs); past an op not traced yet, what it gives run on
        fake tensors (:meth:`_guess`)."""
        found, vals = {}, {}
        self.keys = {}
        for node in self.graph.nodes:
            if node.op == "placeholder":
                vals[node] = self._input_val(node)
            elif node.op != "call_function":
                continue
            elif node.target is operator.getitem:
                vals[node] = vals[node.args[0]][node.args[1]]
            elif node.target is DETACH_:
                vals[node] = vals[node.args[0]]
            elif node.target is _mark:
                vals[node] = self._like(vals[node.args[0]])
            else:
                ins = {a: vals[a] for a in node.all_input_nodes}
                key = self.keys[node] = op_key(node, ins)
                if key in self.templates:
                    vals[node] = self.templates[key][3]
                    continue
                if key not in found:
                    guess = self.guesses.setdefault(key, self._guess(node, ins))
                    if self._kept(node, guess):  # its template made here, not traced
                        self.templates[key] = _as_is(node, self._run(node, ins))
                        vals[node] = self.templates[key][3]
                        continue
                    found[key] = (node, ins)
                vals[node] = self.guesses[key]
        return found

    def _run(self, node, ins):
        """What the op gives on fake tensors as traced: under no_grad, from inputs that
        require no grad (a view of a parameter would, under no_grad alone)."""
        detached = {a: v.detach() if isinstance(v, torch.Tensor) else v for a, v in ins.items()}
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: detached[a])
        with self.fake, torch.no_grad():
            return node.target(*args, **kwargs)

    def _kept(self, node, val) -> bool:
        """Whether the decomposition keeps the op as it is: one with no entry in the
        table, not a composite one, functional, pointwise or a view, of one tensor; as
        run_decompositions traces it, it is itself, its value what it gives on fake
        tensors (``_guess``)."""
        target = node.target
        if target in self.cia or target in self.py_table or not isinstance(val, torch.Tensor):
            return False
        schema = target._schema
        if schema.is_mutable or len(schema.returns) != 1:
            return False
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            return False
        if torch._C._dispatch_has_kernel_for_dispatch_key(
            target.name(), "CompositeImplicitAutograd"
        ):
            return False
        return torch.Tag.pointwise in target.tags or target in _VIEWS

    def _like(self, val):
        """``empty_like(val)`` (the value of a mark), one per layout."""
        key = layout(val)
        if key not in self.likes:
            with self.fake:
                self.likes[key] = torch.empty_like(val)
        return self.likes[key]

    def _guess(self, node, ins):
        """What an op not traced yet gives, for the layouts of the ops after it: its
        decomposition in the table (else the op) run on fake tensors, or as exported."""
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: ins[a])
        fn = self.cia.get(node.target) or self.py_table.get(node.target)
        try:
            with self.fake, torch.no_grad():
                out = fn(*args, **kwargs) if fn is not None else NotImplemented
                return node.target(*args, **kwargs) if out is NotImplemented else out
        except Exception:  # noqa: BLE001  (a guess: a wrong one costs one more batch)
            return node.meta.get("val")

    def _trace_batch(self, items: dict) -> None:
        """Trace ``{key: (node, {input: value})}`` in one graph, the ops one after
        another, each followed by ``add(sep, i)`` (``sep`` is an input no op reads), and
        keep each op's part as its template."""
        mini = torch.fx.Graph()
        sep = mini.placeholder("sep")
        with self.fake:
            sep.meta["val"] = torch.empty(())
        outs, args, order = [], [sep.meta["val"]], []
        for i, (key, (node, vals)) in enumerate(items.items()):
            slots = {}
            for a in node.all_input_nodes:
                slots[a] = mini.placeholder(f"x{len(args)}")
                slots[a].meta["val"] = vals[a]
                args.append(vals[a])
            op = mini.call_function(node.target, *_map((node.args, node.kwargs), slots))
            val = node.meta.get("val")
            if isinstance(val, tuple | list):
                results = [mini.call_function(operator.getitem, (op, j)) for j in range(len(val))]
            else:  # fmt: skip
                results = [] if val is None else [op]  # (an op returning nothing: a check)
            outs += results
            outs.append(mini.call_function(aten.add.Tensor, (sep, i)))
            order.append((key, len(slots), isinstance(val, tuple | list), len(results)))
        mini.output(tuple(outs))
        traced = self._aot(torch.fx.GraphModule(torch.nn.Module(), mini), args)
        self._split(traced, order)

    def _aot(self, gm, args):
        """``gm`` traced as ``run_decompositions`` traces a program (torch's
        ``_export_to_aten_ir``), dead nodes kept: they take names there too."""
        try:
            from torch._guards import TracingContext, tracing
            from torch.export._trace import (
                _aot_export_joint_with_descriptors,
                _compiling_state_context,
                _ignore_backend_decomps,
            )
        except ImportError as e:
            raise Unsupported(f"torch internals: {e}") from None
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.fake)
            stack.enter_context(tracing(TracingContext(self.fake)))
            stack.enter_context(_ignore_backend_decomps())
            stack.enter_context(_compiling_state_context())
            stack.enter_context(torch.no_grad())
            stack.enter_context(_keep_dead_nodes())
            traced, sig = _aot_export_joint_with_descriptors(
                stack, gm, tuple(args), kwargs={}, decompositions=self.py_table,
                fake_params_buffers={}, _record_nn_module_stack=True,
            )  # fmt: skip
        made = any(n.op == "get_attr" for n in traced.graph.nodes)
        if made or len(sig.user_inputs) != len(args):
            raise Unsupported("a decomposition made constants")
        return traced

    def _split(self, traced, order) -> None:
        """Each op's template: its inputs, the nodes between the separators before and
        after it (dead ones too), its outputs and their values."""
        nodes = list(traced.graph.nodes)
        phs = [n for n in nodes if n.op == "placeholder"]
        sep, ins = phs[0], iter(phs[1:])
        body = [n for n in nodes if n.op == "call_function"]
        outs = iter(nodes[-1].args[0])
        start = 0
        for key, n_in, multi, n_out in order:
            end = next(i for i in range(start, len(body)) if sep in body[i].all_input_nodes)
            inputs = [next(ins) for _ in range(n_in)]
            outputs = [next(outs) for _ in range(n_out)]
            next(outs)  # the separator
            if not multi:
                outputs = outputs[0] if outputs else None
            vals = torch.fx.node.map_arg(outputs, lambda o: o.meta.get("val"))
            self.templates[key] = (inputs, body[start:end], outputs, vals)
            start = end + 1

    # -- the new graph -----------------------------------------------------------------

    def _emit(self, new, node, env):
        """What ``node`` becomes in ``new``: a node, a list of them (an op of several
        outputs) or None (one of none)."""
        if node.op == "placeholder":
            ph = new.placeholder(node.name)
            ph.meta = {**node.meta, "val": self._input_val(node)}
            return ph
        if node.op == "output":
            out = new.output(_map(node.args, env)[0])
            out.meta = dict(node.meta)
            return out
        if node.target is operator.getitem:
            return env[node.args[0]][node.args[1]]
        if node.target is DETACH_:  # traced under no_grad, it leaves no node
            return env[node.args[0]]
        if node.target is _mark:  # an identity of ours, kept as it is: no need to trace it
            return self._copy(new, node, env, node)
        vals = {a: env[a].meta["val"] for a in node.all_input_nodes}
        key = self.keys[node] if self.settled else op_key(node, vals)
        if key not in self.templates:
            self._trace_batch({key: (node, vals)})
        inputs, body, outputs, _ = self.templates[key]
        local = {ph: env[a] for ph, a in zip(inputs, node.all_input_nodes)}
        for t in body:
            local[t] = self._copy(new, t, local, node)
        if isinstance(outputs, list):
            return [local[o] for o in outputs]
        return None if outputs is None else local[outputs]

    def _copy(self, new, t, local, origin):
        """Node ``t`` of a template into ``new``, named as tracing names it, with the
        module and source of ``origin`` (the node it decomposes) and its value."""
        args, kwargs = _map((t.args, t.kwargs), local)
        target = t.target
        op = isinstance(target, torch._ops.OpOverload)
        name = new._target_to_str(target.overloadpacket.__name__ if op else target)
        n = new.create_node("call_function", target, args, kwargs, name=name)
        n.meta = (
            {"original_aten": target, "seq_nr": -1}
            if target is _mark
            else {k: v for k, v in t.meta.items() if k in ("original_aten", "seq_nr")}
        )
        n.meta.update({k: copy.copy(origin.meta[k]) for k in _COPIED if k in origin.meta})
        if target is _mark:  # its fake kernel, without the custom op's dispatch
            n.meta["val"] = self._like(self._val(args[0]))
        elif "val" in t.meta:  # the template's: its inputs have this node's layouts (its key)
            n.meta["val"] = t.meta["val"]
        else:
            in_vals = torch.fx.node.map_arg((args, kwargs), self._val)
            with self.fake:
                n.meta["val"] = target(*in_vals[0], **in_vals[1])
        return n

    def _input_val(self, node):
        """An input's value as ``run_decompositions`` traces with it: a fake tensor made
        from the real one, which carries no value of its own (as a constant's may)."""
        val = node.meta["val"]
        if getattr(val, "constant", None) is None:
            return val
        if node not in self.inputs:
            if val.storage_offset():
                raise Unsupported("a constant at an offset")
            with self.fake:
                self.inputs[node] = torch.empty_strided(
                    val.shape, val.stride(), dtype=val.dtype, device=val.device,
                    requires_grad=val.requires_grad,
                )  # fmt: skip
        return self.inputs[node]

    def _val(self, node):
        """``node``'s value for computing those after it: as in the traced graph, nothing
        computed from a parameter requires grad (traced under no_grad)."""
        val = node.meta["val"]
        if not isinstance(val, torch.Tensor) or not val.requires_grad:
            return val
        if node not in self.detached:
            with self.fake:
                self.detached[node] = val.detach()
        return self.detached[node]

    def _program(self, new, env, input_specs):
        """The exported program of graph ``new``, as ``run_decompositions`` makes it."""
        from torch.export.exported_program import _get_updated_range_constraints

        p = self.program
        outs = list(new.output_node().args[0])
        specs = [
            OutputSpec(kind=s.kind, arg=TensorArgument(name=o.name), target=s.target)
            for s, o in zip(p.graph_signature.output_specs, outs)
        ]
        sig = ExportGraphSignature(input_specs=input_specs, output_specs=specs)
        renamed = {
            old.name: env[old].name
            for old in self.graph.nodes
            if isinstance(env.get(old), torch.fx.Node)
        }
        calls = copy.deepcopy(p.module_call_graph)
        for entry in calls:
            if entry.signature is not None:
                for x in (*entry.signature.inputs, *entry.signature.outputs):
                    if getattr(x, "name", None) in renamed:
                        x.name = renamed[x.name]
        # (the program makes its graph module: one code generation for the graph, not two)
        ranges = _get_updated_range_constraints(types.SimpleNamespace(graph=new),
                                                p.range_constraints)  # fmt: skip
        out = torch.export.ExportedProgram(
            root=torch.nn.Module(),
            graph=new,
            graph_signature=sig,
            state_dict=p.state_dict,
            range_constraints=ranges,
            module_call_graph=calls,
            example_inputs=p.example_inputs,
            constants=p.constants,
        )
        out.graph_module.meta.update(p.graph_module.meta)
        return out


#: view ops functionalization keeps as they are
_VIEWS = frozenset({
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.slice.Tensor,
    aten.select.int, aten.transpose.int, aten.permute.default, aten.expand.default,
    aten.t.default, aten.view.default,
})  # fmt: skip


def _as_is(node, val) -> tuple:
    """The template of an op kept as it is: itself, on placeholders of its inputs."""
    mini = torch.fx.Graph()
    slots = {a: mini.placeholder(f"x{i}") for i, a in enumerate(node.all_input_nodes)}
    op = mini.call_function(node.target, *_map((node.args, node.kwargs), slots))
    op.meta = {"val": val, "original_aten": node.target, "seq_nr": node.meta.get("seq_nr")}
    return list(slots.values()), [op], op, val


def _map(value, env):
    return torch.fx.node.map_arg(value, lambda a: env[a])


@contextlib.contextmanager
def _keep_dead_nodes():
    """No dead-code elimination while a batch is traced: in the whole graph, the nodes a
    decomposition leaves unused take names before they are removed, and so must they
    here. (The trace holds the tracing lock; a graph of another thread traced meanwhile
    keeps its dead nodes too, which never changes what it computes.)"""
    dce = torch.fx.Graph.eliminate_dead_code
    torch.fx.Graph.eliminate_dead_code = lambda self, *args, **kwargs: False
    try:
        yield
    finally:
        torch.fx.Graph.eliminate_dead_code = dce


@contextlib.contextmanager
def _no_fake_mode():
    """As ``run_decompositions``: a fake mode the caller is in does not apply."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield

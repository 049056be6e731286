"""One exception family. Every message names the input, the place and the fix."""

from __future__ import annotations


class SemiringBackpropError(Exception):
    """Base class of every error this library raises on purpose.

    Examples:
        >>> try:
        ...     res.at("bert.encoder.layer.7", sbp.Real())
        ... except sbp.SemiringBackpropError as e:
        ...     print(type(e).__name__)
        NotFoundError
    """


class UnsupportedOpError(SemiringBackpropError, NotImplementedError):
    """An op in the traced graph has no rule.

    Examples:
        >>> try:
        ...     sbp.backprop(lambda v: torch.fft.fft(v).real.sum(), (x,))
        ... except sbp.UnsupportedOpError as e:
        ...     print(e)
        no semiring rule for aten._fft_r2c.default at node `_fft_r2c` (it makes a complex
        tensor; only real-valued graphs can be explained). Register one with
        semiring_backprop.rules.register(<op>, kind) ...
    """


class TracingError(SemiringBackpropError):
    """The model could not be traced to an ATen graph.

    Examples:
        A gradient-reversal layer: its backward is not the derivative of its forward.

        >>> class Flip(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(ctx, v):
        ...         return v.clone()
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         return -g
        >>> try:
        ...     sbp.backprop(lambda v: Flip.apply(v).sum(), (x,))
        ... except sbp.TracingError as e:
        ...     print(e)
        the model applies the custom torch.autograd.Function ...Flip, whose backward is not
        the derivative of its forward ...
    """


class InputError(SemiringBackpropError, ValueError):
    """Bad arguments: an output that is not a scalar, an unknown input, and so on.

    Examples:
        >>> try:
        ...     res.at("bert.embeddings.word_embeddings", sbp.LogAbs())
        ... except sbp.InputError as e:
        ...     print(e)
        LogAbs() was not computed in this pass; computed: [Real(), ...]
        >>> issubclass(sbp.InputError, ValueError)
        True
    """


class LoadError(InputError):
    """A model or tokenizer could not be loaded, or loaded only in part (weights that
    transformers would initialize at random).

    Examples:
        >>> from semiring_backprop.hf.explain import explain
        >>> try:
        ...     explain("./no-such-model", "the dog [MASK] on the table", "is", "are")
        ... except sbp.LoadError as e:
        ...     print(e)
        could not load './no-such-model': no such directory. Pass a local directory written
        by model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR), a GGUF file, or a
        hub id.
    """


class PathMismatchError(SemiringBackpropError, RuntimeError):
    """A path read from back-pointers does not reproduce the semiring's value: the
    result is inconsistent (changed after the pass, or a bug); the path is not returned.

    Examples:
        The model's weights change after the pass, before the path is read:

        >>> import copy
        >>> m2 = copy.deepcopy(mlp)
        >>> r = sbp.backprop(m2, (x,), output=lambda y: y[0, 1], semirings=[sbp.MaxProduct()])
        >>> with torch.no_grad():
        ...     _ = m2[0].weight.mul_(-2)
        >>> try:
        ...     r.top_path(0)
        ... except sbp.PathMismatchError as e:
        ...     print(e)
        MaxProduct(neuron) path reading: at node `args_0` element (0, 2) the consumers'
        values ⊕ to hi = 0.0529..., but the pass stored 0.0451.... The result does not
        hold together: ...
    """


class ForwardError(SemiringBackpropError, RuntimeError):
    """Running the traced model on the given inputs failed (an op raised).

    Examples:
        >>> try:
        ...     sbp.backprop(model, kwargs={"input_ids": torch.tensor([[2, 99, 3]])},
        ...                  output=lambda out: out.logits[0, 1, 5])
        ... except sbp.ForwardError as e:
        ...     print(e)
        an id is outside the table of node `embedding` (`bert.embeddings.word_embeddings`):
        99 (of 1 such ids), where the table has 16 rows (ids 0..15). Encode the text with
        the model's own tokenizer.
    """


class NonFiniteError(SemiringBackpropError, FloatingPointError):
    """The forward pass produced NaN or inf.

    Examples:
        >>> try:
        ...     sbp.backprop(lambda v: torch.log(v).sum(), (-x,))
        ... except sbp.NonFiniteError as e:
        ...     print(e)
        the forward pass produced NaN at node `log` (aten.log.default). Check the inputs
        and the model's weights; explanations of a NaN output are meaningless.
    """


class OutOfMemoryError(SemiringBackpropError, MemoryError):
    """A pass could not allocate the memory it needs; the message lists what uses less.

    Examples:
        It is also a ``MemoryError``, so code that handles torch's own out-of-memory
        errors handles it too:

        >>> issubclass(sbp.OutOfMemoryError, MemoryError)
        True
    """


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation failure from torch (CPU or CUDA), under any of its exception types."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and (
        "out of memory" in text.lower() or "can't allocate memory" in text
    )


class TrainingModeError(SemiringBackpropError):
    """The model is in training mode, and its trace holds an op whose result depends on
    the mode: a random one (dropout makes edges random) or batch statistics. A model in
    training mode without such ops (Linear and Tanh layers) is explained as it is.

    Examples:
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Dropout(0.1)).double()
        >>> try:
        ...     sbp.backprop(net, (x,), output=lambda y: y.sum())
        ... except sbp.TrainingModeError as e:
        ...     print(e)
        Sequential is in training mode ('Sequential' and 2 more modules), and in that mode
        '1' (Dropout) applies aten.dropout.default which draws random numbers (dropout: the
        gradient graph would be random). Call model.eval() first, or pass
        allow_training=True to explain the training-mode function as it is.
    """


class NotFoundError(SemiringBackpropError, KeyError):
    """``Result.at`` was asked for a place the graph does not have.

    Examples:
        >>> try:
        ...     res.at("bert.encoder.layer.7", sbp.Real())
        ... except sbp.NotFoundError as e:
        ...     print(e)
        no input, module or node named 'bert.encoder.layer.7' in the traced graph. Did you
        mean: bert.encoder.layer.0, ...? Module paths are those of model.named_modules();
        add ':input' for a module's first input.
    """

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


def where(node, module: str | None) -> str:
    """``while running node `addmm_3` (`bert.encoder.layer.0.attention.self.key`)``."""
    place = f" (`{module}`)" if module else ""
    return f"node `{node.name}`{place}"

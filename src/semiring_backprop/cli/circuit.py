"""``semiring-backprop circuit``: the circuit of a Hugging Face model's choice, printed
and written as EAP-IG JSON, a Neuronpedia graph and HTML."""

from __future__ import annotations

import sys

from .arguments import check_html_file, task_arguments, weights_argument


def add_parser(sub):
    from ..circuits.ig import METHODS
    from ..engine.marginals import SEEDS

    c = sub.add_parser(
        "circuit",
        help="the circuit (heads, MLPs and the edges between them) of a word choice, label "
        "or embedding dimension",
        description="One pass over a Hugging Face model: per attention head, MLP and "
        "position the total flow (Real) and the best path (MaxProduct) of the explained "
        "scalar (--task, as for explain: lm, log p(target) - log p(foil); classification, a "
        "label's logit or its margin to --foil; token, a label's logit at --position; "
        "similarity, one --dim of the pooled embedding), with the edges between them; "
        "written as EAP-IG graph JSON, a Neuronpedia / circuit-tracer attribution graph and "
        "an HTML drawing.",
    )
    task_arguments(
        c,
        pair="classification, token: the second text of a pair",
        target="lm: the word whose log-probability is explained; classification, token: the "
        "label, a name or an index (default: the predicted label)",
    )
    c.add_argument(
        "--dim",
        type=int,
        help="similarity: explain this dimension of the text's pooled embedding (a circuit "
        "is read from one text, so not the similarity of two)",
    )
    c.add_argument(
        "--baseline-text",
        help="a corrupted text of as many tokens: the seed is the difference of the two "
        "texts' token embeddings (x - x'), carried through the relevance graph unless "
        "--weights gradient or --ig-steps says otherwise: an estimate of activation "
        "patching, not equal to it (on SmolLM2, 3 pairs each of five tasks, its site scores "
        "agreed with exact patching at Pearson 0.76-0.97 a task; with --weights gradient, "
        "attribution patching, at 0.42-0.91; with --ig-steps 10 at 0.57-0.99: "
        "docs/faithfulness.md)",
    )
    c.add_argument(
        "--seed",
        choices=SEEDS,
        default="x",
        help="without --baseline-text: x, each source's own value (default), or structural, "
        "one at every element of every source",
    )
    c.add_argument(
        "--ig-steps",
        type=int,
        default=0,
        metavar="N",
        help="with --baseline-text: Real summed over N integrated-gradients steps from the "
        "baseline to the text (each site's conductance; the other semirings stay at the "
        "text); default 0, the seed x - x' at the text alone",
    )
    c.add_argument(
        "--ig-method",
        choices=METHODS,
        default="gausslegendre",
        help="the steps' quadrature, Captum's names (default: gausslegendre)",
    )
    weights_argument(c, default=None, said="the default but with --baseline-text and no "
                     "--ig-steps, where relevance is")  # fmt: skip
    c.add_argument("--top-n", type=int, help="keep the N strongest head/MLP sites (|Real|)")
    c.add_argument("--threshold", type=float, help="keep the sites of |Real| at least this")
    c.add_argument(
        "--cumulative", type=float, help="keep the strongest sites that carry this share of |Real|"
    )
    c.add_argument("--kind", choices=["masked", "causal"], help="lm: default from the config")
    c.add_argument("--device", default="cpu")
    c.add_argument("--json", metavar="FILE", help="write EAP-IG / MIB graph JSON (Real scores)")
    c.add_argument(
        "--neuronpedia", metavar="DIR", help="write a circuit-tracer / Neuronpedia graph here"
    )
    c.add_argument("--html", metavar="FILE", help="write the drawing as one HTML file")


def command(args) -> int:
    import torch

    from ..circuits.hf import circuit_of_text
    from ..errors import InputError, SemiringBackpropError

    try:
        if args.html:
            check_html_file(args.html)
        c = circuit_of_text(
            args.model, args.text, args.target, args.foil, task=args.task,
            text_pair=args.text_pair, position=args.position, pooling=args.pooling,
            score=args.score, dim=args.dim, baseline_text=args.baseline_text,
            kind=args.kind, dtype=getattr(torch, args.dtype), device=args.device,
            seed=args.seed, ig_steps=args.ig_steps, ig_method=args.ig_method,
            gguf_file=args.gguf_file, weights=_weights(args),
        )  # fmt: skip
        if args.top_n is not None or args.threshold is not None or args.cumulative is not None:
            c = c.prune(top_n=args.top_n, threshold=args.threshold, cumulative=args.cumulative)
        print(c.view().text())
        try:
            if args.json:
                c.to_eap_json(args.json)
                print(f"wrote {args.json}")
            if args.neuronpedia:
                from ..hf.explanation import model_name

                slug = "".join(ch if ch.isalnum() else "-" for ch in model_name(c.model_id))
                c.to_neuronpedia(args.neuronpedia, slug=f"{slug}-circuit",
                                 scan=model_name(c.model_id))  # fmt: skip
                print(f"wrote {args.neuronpedia}")
        except OSError as e:
            raise InputError(f"cannot write {e.filename or 'the files'} ({e.strerror})") from None
        if args.html:
            print(f"wrote {c.to_html(args.html)}")
    except SemiringBackpropError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _weights(args) -> str:
    """The edge weights asked for, else the recommended ones (docs/faithfulness.md, "Which
    method to use"): relevance for a baseline's x - x' (the best agreement with exact
    patching over sites at one pass on SmolLM2), the gradient otherwise (integrated
    gradients integrate it; without a baseline the seed is not a patching estimate)."""
    if args.weights is not None:
        return args.weights
    return "relevance" if args.baseline_text and not args.ig_steps else "gradient"

"""The passes over a traced graph, in the order they run.

- :mod:`.forward`: the forward values the rules read;
- :mod:`.structure`: the structural zeros (what a mask makes 0) and the edges they take
  away, handed to the rules (:mod:`.masks`: one call's, from its inputs);
- :mod:`.reverse`: the reverse pass (Algorithm 2 of the paper): D(v) for every node;
- :mod:`.hooks`: what a reverse pass does beside ⊕ (snapshots, liveness, overflow checks,
  the nodes reached), as objects its loop calls;
- :mod:`.alpha`: the forward semiring pass (alpha(v), for max-marginals and circuits);
- :mod:`.liveness`: which values and partial sums each step still needs;
- :mod:`.budget`: refuse a pass that cannot fit in memory, before it starts;
- :mod:`.checkpoints`: the default pass, holding partial sums only at cuts;
- :mod:`.allocator`: the host allocator's settings for large passes.
"""

"""A torch.compile backend that keeps the kbuild ops of the graphs it compiles: aot_autograd
with recording compilers, for the CPU tests that check an op's fake serves torch.compile (the
op, and its backward, appear in the forward and backward graphs)."""

from __future__ import annotations

import torch


class KbuildGraphs:
    """`backend` for torch.compile; `ops["fw"]` / `ops["bw"]`: the names of the kbuild ops of
    the forward and backward graphs (an in-place op counted by name too: the graph wraps it,
    auto_functionalized(op, ...)); `all`: both."""

    def __init__(self) -> None:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.ops: dict[str, set[str]] = {"fw": set(), "bw": set()}

        def recorder(kind):
            def compiler(gm: torch.fx.GraphModule, example_inputs):
                for n in gm.graph.nodes:
                    self.ops[kind] |= {
                        str(a) for a in (n.target, *n.args[:1]) if str(a).startswith("kbuild.")
                    }
                return make_boxed_func(gm)

            return compiler

        self.backend = aot_autograd(fw_compiler=recorder("fw"), bw_compiler=recorder("bw"))

    @property
    def all(self) -> set[str]:
        return self.ops["fw"] | self.ops["bw"]

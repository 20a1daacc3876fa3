"""The propagation engine: the one walker (`walker.propagate`) and the group solvers it calls when
no single equation inverts (linear lumps, consistent choices, nonlinear groups), which receive the
walker's recursion as an argument."""

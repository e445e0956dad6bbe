"""What `init` decides once per parameter tree and mesh: the layout of a zero1 state (`_planner` builds it), and
the `ZeroState` pytree that carries it."""

"""Private implementation of :mod:`maml`; import from ``maml`` instead."""

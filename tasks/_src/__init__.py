"""Private implementation of :mod:`tasks`; import from ``tasks`` instead."""

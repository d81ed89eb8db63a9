"""Backends: the piecewise compile backend (split around attention, per-range compile, warm
restore), the compiler adaptors (``compiler``: inductor, eager, plugins) and attention backends."""

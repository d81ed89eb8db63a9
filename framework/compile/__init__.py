"""The compile spine's front: trace the model once with Dynamo (``trace_once``) and build the
step callable for a compilation mode (``build``: eager or piecewise)."""

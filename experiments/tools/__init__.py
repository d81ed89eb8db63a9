"""Tools: the capture/compile size chooser (from a trace) and the compiled-graph viewer."""

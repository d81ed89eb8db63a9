"""CUDA graphs: the wrapper that captures/replays a runnable (``wrapper``), the dispatcher that
picks mode and padded batch descriptor per step (``dispatcher``), mode selection (``setup``)."""

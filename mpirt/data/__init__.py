"""Token datasets: preparing, reading window by window, batching (tokens); ``python -m mpirt.data``."""

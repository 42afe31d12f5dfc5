"""`tapd demo`: a daemon, a subscriber and a small JAX training loop with taps."""

"""The emitting side: what runs in the JAX process.

`sender` (no JAX) owns the connection to the daemon and the byte-bounded buffer;
`tapping` (JAX) builds the taps that feed it; `settings` holds the emitter's config.
"""

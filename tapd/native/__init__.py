"""tapd's native hot path: the XLA FFI tap handler and the shared-memory ring.

`library` finds (or builds) the compiled library and binds its C functions; `ring`
wraps a ring for the emitter and the daemon. Neither imports JAX.
"""

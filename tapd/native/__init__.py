"""tapd's native hot path: the shared-memory ring and the XLA FFI tap handlers.

C++: `ring.h`/`ring.cc` (the ring and its C API; a C++ compiler is all they need),
`ffi_cpu.cc` (the CPU handler, built into the ring's library where jaxlib's FFI headers
are), `ffi_cuda.cc` (the CUDA handler, a library of its own, where the CUDA runtime is).
`build` says where headers are and how to compile; `library` finds (or builds) the
libraries and binds their C functions, never raising; `ring` wraps a ring for the
emitter and the daemon; `sites` is the sites-file format. None of them imports JAX.
"""

"""The gathered path: a computation's taps kept on the device and moved out together.

On a TPU every host callback is a transfer to the host (0.4 to 1 ms, whatever its size
up to a MiB; docs/TAPPING.md), so a tap that is its own host callback costs as much as
the `jax.debug.callback` it replaces. A gathered computation moves its taps in few
transfers instead. Before JAX lowers it (`maybe_gathered`, called by
`tapd.emitter.lowering` on the whole computation; the rewrite itself is
`tapd.emitter.gathered.rewrite`), each tap becomes a write into device buffers that the
computation carries: the tapped operands into its site's rows, its site's
index into the log. Loops (`scan`, `while`) and branches (`cond`) carry the buffers
too, so the log is in program order however the taps nest. A flush
(`tapd.emitter.gathered.flush`) is one host callback that takes the buffers, and writes
each logged record, in order, as the tap's own host callback would have (the same ring
record, so subscribers cannot tell the paths apart). It runs where the log could
fill (at most `gather_taps` records, or `gather_bytes` of buffers), at the end of a
computation that cannot end with its buffers as an output, and, on one device, where a
long loop's chunk ends: such a loop is paced by the host so that its taps arrive
within `gather_latency` seconds (tapd.emitter.gathered.live), and each flush there
answers with fresh wake flags.

Flushes run in program order: each carries an ordered effect of tapd's own, whose
token JAX threads from flush to flush through the loops and branches; the token is made
inside the computation (`program_order.ordered_call_p` holds the rewritten jaxpr), so
that JAX's dispatch sees an unordered tap and keeps its fast path. The buffers are never
cleared: a flush reads only the rows its log names.

Only a computation whose every tap would be a host callback is gathered, and only
whole: a tap in a region the rewrite does not enter (a loop's condition) leaves the
computation to the per-tap path, so that its taps keep one order. A computation on one
device is gathered as above; one whose taps all lie in `shard_map` or `pmap` bodies
gathers on each device: one body's buffers leave as that device's shard of the output
(tapd.emitter.gathered.slices), many bodies' over one mesh are carried across them
(tapd.emitter.gathered.threaded: an Explicit mesh's taps, a shard_map in a loop), else
each body is gathered and flushed on its own; a `jit` the compiler partitions over
several devices, whose taps are of whole values on its first device, is gathered there
and flushed at its end.

The room (this package), from the top:
- choose.py: which computations are gathered (`maybe_gathered`), and the rewrite's plan;
- rewrite.py: the jaxpr evaluated with each tap turned into writes into the buffers;
- live.py: a long loop's taps within `gather_latency`: which loops, their chunks, the pace;
- slices.py: a computation over several devices, each shard_map body gathered on each;
- threaded.py: over several devices, the buffers carried across many shard_map bodies;
- flush.py: the flush primitive, and the gathered computation's call and way out;
- host.py: the packed buffers' layout, and what writes them into the ring on the host;
- module_pass.py: the MLIR pass that joins a computation's way out to JAX's token slots.

The rest of the emitter sees only this face: `maybe_gathered`, called by
`tapd.emitter.lowering` on each computation it lowers, and the module pass around that
lowering (`start_module`, `module_way_out`, `attach_way_out`).
"""

from tapd.emitter.gathered.choose import maybe_gathered
from tapd.emitter.gathered.module_pass import attach as attach_way_out
from tapd.emitter.gathered.module_pass import start as start_module
from tapd.emitter.gathered.module_pass import taken as module_way_out

__all__ = ["attach_way_out", "maybe_gathered", "module_way_out", "start_module"]

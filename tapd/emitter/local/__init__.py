"""This process's own tap functions, received and run here (no daemon between them).

- functions.py: a local tap function (its name for people, its argument rebuilt);
- threads.py: which threads are tapd's receivers (nothing there may wait for itself);
- path.py: `LocalPath`, the local ring and the receiver thread that drains it, with the
  waits on it (barrier, catch-up, exit drain); sites.py: its functions' consumer names
  and site ids; runner.py: the running of what the receiver reads;
- fallback.py: `FallbackReceiver`, the receiver a daemon feeds (importable functions that
  no subscriber takes; every local function where the native library does not load).

tapd.emitter.lifecycle makes them, once a process, and wires them to the rest; none of
these modules imports it.
"""

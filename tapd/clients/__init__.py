"""tapd's own clients of a daemon, over its sockets: `control` (the `stats` and
`shutdown` requests behind `tapd status`, `check` and `stop`) and `emitter_socket` (the
emitter's end of a connection, which the sender thread, the forwarder and the replayer
share). None of them imports the daemon or JAX; the subscriber library is
client/tapd_client.
"""

"""Programs built on the subscriber library and the wire protocol: `tapd record`,
`tapd replay` (recording.py is the on-disk format), `tapd top`."""

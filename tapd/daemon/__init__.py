"""The receiver daemon (`tapd start`): `server` does sockets and lifecycle, `router`
the routing state, `control` the small client for `status`/`check`/`stop`."""

"""The receiver daemon (`tapd start`): `server` does sockets and lifecycle, `router`
the routing state. (Its client for `status`/`check`/`stop` is tapd/clients/control.py.)"""

"""What the router routes to: one class per kind of target (tapd/daemon/targets/base.py
says what every target does).

- `socket.SocketSubscriber`: a subscriber process, over a socket, with a window;
- `shm.ShmSubscriber`: one on this host that reads large ring taps from the ring;
- `local.LocalTarget`: a subscriber in this daemon's process (the forwarder);
- `pool.Pool`: a worker pool, whose members are socket subscribers;
- `spooled.Spooled`: any of them, under the spool policy, wrapped with its spool.
"""

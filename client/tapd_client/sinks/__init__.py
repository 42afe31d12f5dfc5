"""Handlers that send taps to the tools users already look at. Each imports its tool's
library only when made, so `tapd_client` stays light: `pip install 'tapd[tensorboard]'`.

    from tapd_client import Subscriber
    from tapd_client.sinks.tensorboard import TensorBoardSink

    sub = Subscriber()
    sub.add_handler("loss", TensorBoardSink("runs/exp1"))
"""

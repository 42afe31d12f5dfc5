"""tapd's subscriber library: run tap functions on values tapped in JAX programs.

    from tapd_client import Subscriber

    sub = Subscriber()              # the local daemon, or Subscriber("tcp://host:port")

    @sub.on("loss")
    def show(arg, meta):
        print(meta.step, float(arg))

    sub.run()

Importing this package does not import JAX.
"""

from tapd_client.assemble import Assembler
from tapd_client.batch import TapBatch
from tapd_client.handlers import BatchHandler, Handler
from tapd_client.meta import ShardInfo, TapMeta
from tapd_client.subscriber import Subscriber

__all__ = ["Assembler", "BatchHandler", "Handler", "ShardInfo", "Subscriber", "TapBatch", "TapMeta"]

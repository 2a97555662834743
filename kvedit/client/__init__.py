"""The client side of the kvedit server, used by the SDK, the vLLM connector and the tools.

kv_client (`KVClient`: session, register, lookup, store, retrieve, delete, stats) · transport
(how chunk bytes move, chosen once at connect: shared memory or the data link) · handles (what
calls return: `KVError`, `StoreHandle`, `Retrieved`) · datalink (the client end of the raw-TCP
data link) · l2_wait (wait until a server's write-behind to its Redis tier has drained).
Nothing here imports `kvedit.server`: both sides share only `protocol`, `wire` and `auth`.
"""
from kvedit.client.handles import KVError, Retrieved, ServerUnavailable, StoreHandle, StoreResult
from kvedit.client.kv_client import KVClient
from kvedit.protocol import ServerInfo

__all__ = ["KVClient", "KVError", "ServerUnavailable", "ServerInfo", "StoreHandle",
           "StoreResult", "Retrieved"]

"""Ref streams: SampleRefs from producers to consumer ranks, with a bounded credit window.

``ZmqRefSender`` (one per producer) and ``ZmqRefReceiver`` (one per consumer
rank) speak a versioned JSON wire format over ZeroMQ; plug them into
``Producer(..., stream=sender)`` and ``Consumer(..., stream=receiver)``.
``MemoryStream`` gives in-process pairs with the same semantics, for unit
tests. docs/streams.md describes the wire format, the window, end of stream,
restarts and CURVE security.
"""

from dataflow.streams._memory import MemoryRefReceiver, MemoryRefSender, MemoryStream
from dataflow.streams._receiver import ReceiverConfig, ZmqRefReceiver
from dataflow.streams._security import CurveClientConfig, CurveServerConfig
from dataflow.streams._sender import SenderConfig, SenderStats, ZmqRefSender
from dataflow.streams._window import ReceiverStats

__all__ = [
    "CurveClientConfig",
    "CurveServerConfig",
    "MemoryRefReceiver",
    "MemoryRefSender",
    "MemoryStream",
    "ReceiverConfig",
    "ReceiverStats",
    "SenderConfig",
    "SenderStats",
    "ZmqRefReceiver",
    "ZmqRefSender",
]

"""The live run: producers, consumers, backpressure, metrics and collectives."""

from dataflow.live._collectives import (
    agree,
    broadcast_int,
    communication_device,
    exchange,
    flag_device,
    group_active,
    join_gloo,
    join_loopback_gloo,
    reduce_max,
)
from dataflow.live._consumer import Consumer
from dataflow.live._producer import Producer
from dataflow.live._replay import replay
from dataflow.live._view import RunView

__all__ = [
    "Consumer",
    "Producer",
    "RunView",
    "agree",
    "broadcast_int",
    "communication_device",
    "exchange",
    "flag_device",
    "group_active",
    "join_gloo",
    "join_loopback_gloo",
    "reduce_max",
    "replay",
]

"""Typed access to the lifespan state (the gateway and its proxy) from a request."""

from __future__ import annotations

from typing import TypedDict

from fastapi import Request

from .proxy import Proxy
from .runtime import Gateway


class LifespanState(TypedDict):
    gateway: Gateway
    proxy: Proxy


def gateway_of(request: Request) -> Gateway:
    gw: Gateway = request.state.gateway
    return gw


def proxy_of(request: Request) -> Proxy:
    proxy: Proxy = request.state.proxy
    return proxy

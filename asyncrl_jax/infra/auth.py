"""A shared-secret token for every gRPC server that binds beyond this machine.

Servers (the rollout service, the learner's registry, JetStream serving) bind 127.0.0.1 by default.
Binding any other address needs a token, given as a file (``rollout.auth_token_file``, serve's
``--auth_token_file``) or in ``ASYNCRL_AUTH_TOKEN``; without one the process refuses to start, naming
the option. With a token, every RPC must carry it (metadata ``x-asyncrl-token``); it is compared in
constant time and a call without it fails with UNAUTHENTICATED. Clients send it on every call.

There is no TLS: the token travels in clear, so the traffic must stay on the slice's private network
(the VPC of the TPU slices). ``jax.experimental.transfer``'s weight server has no authentication of its
own; what protects it is that its transfer uuids are random (``transfer.new_uuid``) and reach a decode
server only through the (token-checked) control plane.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from typing import Optional

import grpc

ENV = "ASYNCRL_AUTH_TOKEN"
METADATA_KEY = "x-asyncrl-token"
_DENIED = "missing or wrong x-asyncrl-token (the shared secret of ASYNCRL_AUTH_TOKEN / auth_token_file)"


class AuthError(ValueError):
  """Binding beyond loopback without a token, or a token file that cannot be used."""


def is_loopback(host: str) -> bool:
  host = host.strip("[]")
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False  # a host name or 0.0.0.0-style wildcard is not loopback


def load_token(token_file: str = "") -> Optional[str]:
  """The token from ``ASYNCRL_AUTH_TOKEN`` or ``token_file`` (both: they must agree); None if neither."""
  from_env = os.environ.get(ENV, "").strip() or None
  from_file = None
  if token_file:
    try:
      with open(token_file) as f:
        from_file = f.read().strip()
    except OSError as e:
      raise AuthError(f"auth token file {token_file!r}: {e.strerror}") from e
    if not from_file:
      raise AuthError(f"auth token file {token_file!r} is empty")
  if from_env and from_file and from_env != from_file:
    raise AuthError(f"{ENV} and the auth token file {token_file!r} hold different tokens")
  token = from_env or from_file
  if token is not None and len(token) < 16:
    raise AuthError(f"the auth token has {len(token)} characters; use at least 16 (e.g. "
                    "`openssl rand -hex 32`)")
  return token


def require(host: str, token: Optional[str], option: str) -> None:
  """Refuses to bind a non-loopback ``host`` without a token (``option`` names the host setting)."""
  if token is None and not is_loopback(host):
    raise AuthError(f"{option}={host!r} is not a loopback address, so anyone who can reach it could "
                    f"call it: give a shared secret with {ENV} or an auth_token_file (checked on every "
                    f"RPC), or bind 127.0.0.1")


def _ok(metadata, token: str) -> bool:
  sent = dict(metadata or ()).get(METADATA_KEY, "")
  return hmac.compare_digest(sent.encode(), token.encode())


def _deny(request, context):
  context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)


class ServerToken(grpc.ServerInterceptor):
  """Rejects every call that does not carry the token."""

  def __init__(self, token: str):
    self.token = token

  def intercept_service(self, continuation, handler_call_details):
    if _ok(handler_call_details.invocation_metadata, self.token):
      return continuation(handler_call_details)
    return grpc.unary_unary_rpc_method_handler(_deny)


class AioServerToken(grpc.aio.ServerInterceptor):
  """The same for an asyncio gRPC server (JetStream's)."""

  def __init__(self, token: str):
    self.token = token

  async def intercept_service(self, continuation, handler_call_details):
    if _ok(handler_call_details.invocation_metadata, self.token):
      return await continuation(handler_call_details)

    async def deny(request, context):
      await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
    return grpc.unary_unary_rpc_method_handler(deny)


def server_interceptors(token: Optional[str]) -> list:
  return [ServerToken(token)] if token else []


class _Call(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
  def __init__(self, token: str):
    self.metadata = ((METADATA_KEY, token),)

  def _with_token(self, details):  # (grpc passes its call details as a namedtuple)
    return details._replace(metadata=tuple(details.metadata or ()) + self.metadata)

  def intercept_unary_unary(self, continuation, details, request):
    return continuation(self._with_token(details), request)

  def intercept_unary_stream(self, continuation, details, request):
    return continuation(self._with_token(details), request)


def channel(address: str, token: Optional[str] = None, options=()) -> grpc.Channel:
  """A client channel to ``address`` that sends ``token`` (if any) on every call."""
  ch = grpc.insecure_channel(address, options=list(options))
  return grpc.intercept_channel(ch, _Call(token)) if token else ch

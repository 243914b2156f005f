"""Protobuf messages of the rollout streaming service (``asyncrl.rollout.v1``), built at import time.

The schema is declared here in code (equivalent .proto below) so no generated modules or protoc are
needed and it works with any protobuf runtime. Only protobuf crosses the wire: nothing is pickled.

  package asyncrl.rollout.v1;
  message RolloutRequest { string request_id = 1; repeated int32 prompt_tokens = 2;
                           int32 max_new_tokens = 3; string prompt_id = 4; int64 group_id = 5;
                           int64 incarnation = 6;     // of the learner asking (0: none)
                           int32 min_new_tokens = 7;   // no stop token before this many
                           string episode_json = 8; }  // a multi-turn episode's spec ("": none)
  message SubmitRequest  { repeated RolloutRequest requests = 1; }
  message SubmitReply    { int32 accepted = 1; }
  message StreamRequest  { int32 max_trajectories = 1; }        // 0: until cancelled
  message Trajectory     { string trajectory_id = 1; string prompt_id = 2; int64 group_id = 3;
                           repeated int32 prompt_tokens = 4; repeated int32 completion_tokens = 5;
                           repeated float logprobs = 6; repeated int32 versions = 7;
                           string finish_reason = 8; string logprob_source = 9;
                           string sampling_json = 10; string tokenizer_id = 11; string server_id = 12;
                           int32 num_interruptions = 13; string error = 14;
                           double started_at = 15; double finished_at = 16;
                           int64 incarnation = 17; repeated int32 action_mask = 18;
                           string turns_json = 19; }  // an episode's turns ("": not an episode)
  // one per learner process: its transfer server, the uuid of this pull, the blocks it offers
  // (JSON [[leaf, [[start, stop], ...]], ...], see transfer.shards)
  message WeightSource   { string address = 1; int64 uuid = 2; string blocks_json = 3; }
  // incarnation: of the learner sending it; a newer one than the server serves may send any version.
  // base_id: the learner's name for its frozen base weights (LoRA; 0: none); partial = 1: the sources
  // offer the adapters alone, to go over the base the server holds, which must be base_id
  message WeightsNotice  { int64 version = 1; repeated WeightSource sources = 4; int64 incarnation = 5;
                           int64 base_id = 6; int32 partial = 7; }
  // source_bytes: bytes pulled from each source, in the notice's order
  message WeightsReply   { int64 version = 1; double seconds = 2; int64 bytes = 3;
                           repeated int64 source_bytes = 4; }
  message AbortRequest   { string request_id = 1; }
  message AckRequest     { repeated string trajectory_ids = 1; }
  message Empty {}
  // cumulative decode counters since the server started: one field per field of
  // rollout.stats.DecodeStats, in its order (int64 for counts, double for seconds), numbered from 1
  message DecodeStats    { int64 tokens = 1; int64 steps = 2; int64 slot_steps = 3; ... }
  // status: "serving", "warming_up" (compiling prefill shapes in the background), "draining"
  // (stopping: takes no new work), or "error"; incarnation: of the learner whose work it serves
  message HealthReply    { string status = 1; int64 version = 2; int32 active = 3; int32 queued = 4;
                           string server_id = 6; string error = 7; int64 incarnation = 8;
                           DecodeStats stats = 14; }
  // a decode server announcing itself to the learner (process 0), and again every few seconds:
  // learner_incarnation is the incarnation its last registration was accepted by (0: none), so a
  // repeat to the same learner at the same address changes nothing, and a new learner sees it;
  // sandbox_json: where its episodes run model-written code, how (envs.sandbox_status: "sandboxed",
  // "why"); "" where they run none
  message RegisterRequest { string server_id = 1; string address = 2; string model_config_json = 3;
                            string tokenizer_id = 4; int32 devices = 5; string mesh_json = 6;
                            int64 learner_incarnation = 7; string sandbox_json = 8; }
  // registered: servers registered so far, this one included; incarnation: the learner's
  message RegisterReply   { int32 registered = 1; int64 incarnation = 2; }
  service Learner { rpc Register(RegisterRequest) returns (RegisterReply); }
  service Rollout {
    rpc Submit(SubmitRequest) returns (SubmitReply);
    rpc Stream(StreamRequest) returns (stream Trajectory);
    rpc UpdateWeights(WeightsNotice) returns (WeightsReply);
    rpc Ack(AckRequest) returns (Empty);
    rpc Abort(AbortRequest) returns (Empty);
    rpc Health(Empty) returns (HealthReply);
  }
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from asyncrl_jax.rl.trajectory import RolloutRequest, Trajectory, Turn
from asyncrl_jax.rollout.stats import DecodeStats
from asyncrl_jax.weights import shards
from asyncrl_jax.weights.remote import Source

PACKAGE = "asyncrl.rollout.v1"
# Largest message either side sends or accepts (a Submit of 512 prompts of 1024 tokens is ~2 MB, a
# 32k-token trajectory ~0.4 MB; with recorded routes, 2 L_moe k bytes more per token: 25 MB at 32k
# for Qwen3-30B-A3B, 98 MB at 64k for Qwen3-235B-A22B): a larger one fails with RESOURCE_EXHAUSTED
# instead of being read.
MAX_MESSAGE_BYTES = 128 * 2 ** 20
GRPC_OPTIONS = (("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES))
SERVICE = f"{PACKAGE}.Rollout"
LEARNER_SERVICE = f"{PACKAGE}.Learner"

_F = descriptor_pb2.FieldDescriptorProto
_TYPES = {"string": _F.TYPE_STRING, "int32": _F.TYPE_INT32, "int64": _F.TYPE_INT64,
          "float": _F.TYPE_FLOAT, "double": _F.TYPE_DOUBLE, "bytes": _F.TYPE_BYTES}

_MESSAGES = {
    "RolloutRequest": [("request_id", "string", 1), ("prompt_tokens", "int32*", 2),
                       ("max_new_tokens", "int32", 3), ("prompt_id", "string", 4),
                       ("group_id", "int64", 5), ("incarnation", "int64", 6),
                       ("min_new_tokens", "int32", 7), ("episode_json", "string", 8)],
    "SubmitRequest": [("requests", ".RolloutRequest*", 1)],
    "SubmitReply": [("accepted", "int32", 1)],
    "StreamRequest": [("max_trajectories", "int32", 1)],
    "Trajectory": [("trajectory_id", "string", 1), ("prompt_id", "string", 2), ("group_id", "int64", 3),
                   ("prompt_tokens", "int32*", 4), ("completion_tokens", "int32*", 5),
                   ("logprobs", "float*", 6), ("versions", "int32*", 7), ("finish_reason", "string", 8),
                   ("logprob_source", "string", 9), ("sampling_json", "string", 10),
                   ("tokenizer_id", "string", 11), ("server_id", "string", 12),
                   ("num_interruptions", "int32", 13), ("error", "string", 14),
                   ("started_at", "double", 15), ("finished_at", "double", 16),
                   ("incarnation", "int64", 17), ("action_mask", "int32*", 18),
                   ("turns_json", "string", 19),
                   # routing replay: int16 little-endian routes and their shape [P + C, L_moe, k]
                   ("routes", "bytes", 20), ("routes_shape", "int32*", 21)],
    "WeightSource": [("address", "string", 1), ("uuid", "int64", 2), ("blocks_json", "string", 3)],
    "WeightsNotice": [("version", "int64", 1), ("sources", ".WeightSource*", 4),
                      ("incarnation", "int64", 5), ("base_id", "int64", 6), ("partial", "int32", 7)],
    "WeightsReply": [("version", "int64", 1), ("seconds", "double", 2), ("bytes", "int64", 3),
                     ("source_bytes", "int64*", 4)],
    "RegisterRequest": [("server_id", "string", 1), ("address", "string", 2),
                        ("model_config_json", "string", 3), ("tokenizer_id", "string", 4),
                        ("devices", "int32", 5), ("mesh_json", "string", 6),
                        ("learner_incarnation", "int64", 7), ("sandbox_json", "string", 8)],
    "RegisterReply": [("registered", "int32", 1), ("incarnation", "int64", 2)],
    "AbortRequest": [("request_id", "string", 1)],
    "AckRequest": [("trajectory_ids", "string*", 1)],
    "Empty": [],
    # New counters go at the end of DecodeStats, so existing field numbers keep their meaning.
    "DecodeStats": [(f.name, "double" if f.type in (float, "float") else "int64", i)
                    for i, f in enumerate(dataclasses.fields(DecodeStats), start=1)],
    "HealthReply": [("status", "string", 1), ("version", "int64", 2), ("active", "int32", 3),
                    ("queued", "int32", 4), ("server_id", "string", 6), ("error", "string", 7),
                    ("incarnation", "int64", 8), ("stats", ".DecodeStats", 14)],
}

METHODS = {  # name: (request, reply, server streaming)
    "Submit": ("SubmitRequest", "SubmitReply", False),
    "Stream": ("StreamRequest", "Trajectory", True),
    "UpdateWeights": ("WeightsNotice", "WeightsReply", False),
    "Ack": ("AckRequest", "Empty", False),
    "Abort": ("AbortRequest", "Empty", False),
    "Health": ("Empty", "HealthReply", False),
}
LEARNER_METHODS = {"Register": ("RegisterRequest", "RegisterReply", False)}


def _build():
  file = descriptor_pb2.FileDescriptorProto(name="asyncrl_rollout_v1.proto", package=PACKAGE,
                                            syntax="proto3")
  for name, fields in _MESSAGES.items():
    msg = file.message_type.add(name=name)
    for field_name, kind, number in fields:
      repeated = kind.endswith("*")
      kind = kind.rstrip("*")
      f = msg.field.add(name=field_name, number=number,
                        label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
      if kind.startswith("."):
        f.type, f.type_name = _F.TYPE_MESSAGE, f".{PACKAGE}{kind}"
      else:
        f.type = _TYPES[kind]
  pool = descriptor_pool.DescriptorPool()
  pool.Add(file)
  return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
          for name in _MESSAGES}


MESSAGES = _build()


def request_to_pb(r: RolloutRequest):
  return MESSAGES["RolloutRequest"](request_id=r.request_id, prompt_tokens=[int(t) for t in r.prompt_tokens],
                                    max_new_tokens=r.max_new_tokens, prompt_id=r.prompt_id,
                                    group_id=r.group_id, incarnation=r.incarnation,
                                    min_new_tokens=r.min_new_tokens,
                                    episode_json="" if r.episode is None else json.dumps(r.episode))


def request_from_pb(m) -> RolloutRequest:
  if not m.request_id:
    raise ValueError("RolloutRequest.request_id is empty (trajectory ids must be unique)")
  episode = None
  if m.episode_json:
    episode = json.loads(m.episode_json)
    if not isinstance(episode, dict) or "env" not in episode:
      raise ValueError(f"RolloutRequest.episode_json is not an episode spec: {m.episode_json[:80]!r}")
  return RolloutRequest(prompt_tokens=list(m.prompt_tokens), max_new_tokens=m.max_new_tokens,
                        request_id=m.request_id, prompt_id=m.prompt_id, group_id=m.group_id,
                        incarnation=m.incarnation, min_new_tokens=m.min_new_tokens, episode=episode)


def trajectory_to_pb(t: Trajectory):
  return MESSAGES["Trajectory"](
      trajectory_id=t.trajectory_id, prompt_id=t.prompt_id, group_id=t.group_id,
      prompt_tokens=t.prompt_tokens.tolist(), completion_tokens=t.completion_tokens.tolist(),
      logprobs=t.logprobs.tolist(), versions=t.versions.tolist(), finish_reason=t.finish_reason,
      logprob_source=t.logprob_source, sampling_json=json.dumps(t.sampling, sort_keys=True),
      tokenizer_id=t.tokenizer_id, server_id=t.server_id, num_interruptions=t.num_interruptions,
      error=t.error, started_at=t.started_at, finished_at=t.finished_at, incarnation=t.incarnation,
      action_mask=[] if t.action_mask is None else np.asarray(t.action_mask).tolist(),
      turns_json="" if t.turns is None else json.dumps([turn_to_json(turn) for turn in t.turns]),
      routes=b"" if t.routes is None else np.asarray(t.routes, "<i2").tobytes(),
      routes_shape=[] if t.routes is None else list(np.shape(t.routes)))


def trajectory_from_pb(m) -> Trajectory:
  """The trajectory; a message that does not make one (lengths that disagree, an unknown finish
  reason, sampling settings that are not JSON) becomes a failed trajectory under the same id whose
  error names the problem, so the controller counts and retries it rather than the stream breaking
  on it (and the server sending it again, for ever)."""
  try:
    return _trajectory_from_pb(m)
  except (ValueError, TypeError) as e:
    request = RolloutRequest(prompt_tokens=list(m.prompt_tokens), max_new_tokens=0,
                             request_id=m.trajectory_id, prompt_id=m.prompt_id, group_id=m.group_id,
                             incarnation=m.incarnation)
    return Trajectory.failed(request, f"malformed trajectory message: {e}"[:500],
                             tokenizer_id=m.tokenizer_id, server_id=m.server_id)


def _trajectory_from_pb(m) -> Trajectory:
  sampling = json.loads(m.sampling_json or "{}")
  if not isinstance(sampling, dict):
    raise ValueError(f"sampling_json is not an object: {m.sampling_json[:80]!r}")
  return Trajectory(
      trajectory_id=m.trajectory_id, prompt_id=m.prompt_id, group_id=m.group_id,
      prompt_tokens=np.asarray(m.prompt_tokens, np.int32),
      completion_tokens=np.asarray(m.completion_tokens, np.int32),
      logprobs=np.asarray(m.logprobs, np.float32), versions=np.asarray(m.versions, np.int32),
      finish_reason=m.finish_reason, logprob_source=m.logprob_source,
      sampling=sampling, tokenizer_id=m.tokenizer_id,
      server_id=m.server_id, num_interruptions=m.num_interruptions, error=m.error,
      started_at=m.started_at, finished_at=m.finished_at, incarnation=m.incarnation,
      action_mask=np.asarray(m.action_mask, np.int32) if len(m.action_mask) else None,
      turns=_turns(m.turns_json), routes=_routes(m.routes, list(m.routes_shape)))


def _routes(data: bytes, shape: list):
  if not shape and not data:
    return None
  if len(shape) != 3 or any(s < 0 for s in shape) or int(np.prod(shape)) * 2 != len(data):
    raise ValueError(f"routes: {len(data)} bytes do not hold int16 routes of shape {shape}")
  return np.frombuffer(data, "<i2").reshape(shape).astype(np.int16)


def _turns(text: str):
  if not text:
    return None
  turns = json.loads(text)
  if not isinstance(turns, list):
    raise ValueError(f"turns_json is not a list of turns: {text[:80]!r}")
  return tuple(turn_from_json(t, k) for k, t in enumerate(turns))


def turn_to_json(turn: Turn) -> dict:
  """An episode's turn as JSON (the wire, ``trajectories.jsonl``): ``{"action": [start, end),
  "observation": [start, end), "ended", "reward", "latency", "error", "info"}``."""
  return {"action": list(turn.action), "observation": list(turn.observation), "ended": turn.ended,
          "reward": turn.reward, "latency": turn.latency, "error": turn.error, "info": dict(turn.info)}


def turn_from_json(d, k: int = 0) -> Turn:
  """The turn ``turn_to_json`` wrote; a ``ValueError`` naming turn ``k``'s bad field otherwise."""
  if not isinstance(d, dict):
    raise ValueError(f"turns_json: turn {k} is not an object")
  ranges = {}
  for field in ("action", "observation"):
    r = d.get(field)
    if not (isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                       for x in r)):
      raise ValueError(f"turns_json: turn {k} has no [start, end) {field} range of integers")
    ranges[field] = tuple(r)
  try:
    reward, latency = float(d.get("reward", 0.0)), float(d.get("latency", 0.0))
  except (TypeError, ValueError):
    raise ValueError(f"turns_json: turn {k}'s reward or latency is not a number") from None
  info = d.get("info", {})
  if not isinstance(info, dict) or not isinstance(d.get("ended", ""), str) \
      or not isinstance(d.get("error", ""), str):
    raise ValueError(f"turns_json: turn {k}'s ended, error or info has the wrong type")
  return Turn(action=ranges["action"], observation=ranges["observation"], ended=d.get("ended", "stop"),
              reward=reward, latency=latency, error=d.get("error", ""), info=info)


def sources_to_pb(sources) -> list:
  """``transfer.remote.Source`` records as ``WeightSource`` messages."""
  return [MESSAGES["WeightSource"](address=s.address, uuid=s.uuid, blocks_json=shards.blocks_to_json(s.blocks))
          for s in sources]


def sources_from_pb(messages) -> list:
  if not messages:
    raise ValueError("the weights notice names no source")
  return [Source(m.address, m.uuid, tuple(shards.blocks_from_json(m.blocks_json))) for m in messages]


def stats_to_pb(stats: DecodeStats):
  return MESSAGES["DecodeStats"](**dataclasses.asdict(stats))


def stats_from_pb(message) -> DecodeStats:
  return DecodeStats(**{f.name: getattr(message, f.name) for f in dataclasses.fields(DecodeStats)})
